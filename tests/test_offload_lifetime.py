"""OffloadAdam's engine across threads and processes: close() while another thread is inside a call (a DDP
comm hook's grad_ready), two close() at once, a process forked from one with an engine (it has none of the
engine's threads) and effmem's CPU kernels in a forked DataLoader worker, and add_param_group refused by the
engine itself. Each case that could crash or hang runs in a child process with a time limit."""
import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from effmem import OffloadAdam

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and the host engine: Linux")


def run_child(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter; on a hang, kills it and whatever it forked."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung for {timeout} s; output: {out[-1000:]} {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_close_waits_for_a_call_on_another_thread_and_two_closes_take_turns():
    r = run_child("""
        import threading, torch
        from effmem import _C
        for trial in range(60):
            ps = [torch.zeros(1 << 14) for _ in range(8)]
            e = _C.OffloadEngine(ps, [0] * 8, [0] * 8, [True] * 8, 1, backend="host", num_threads=1)
            e.set_group(0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                        bias_correction=True)
            g, go = torch.ones(1 << 14), threading.Event()
            def other():
                go.wait()
                try:
                    for k in range(10000):
                        e.grad_ready(k % 8, g) if trial % 2 else e.close()
                except RuntimeError as err:
                    assert "closed" in str(err), err
            t = threading.Thread(target=other)
            t.start()
            go.set()
            e.close()
            t.join()
        print("done")
    """)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("then", ["exit", "close", "step"])
def test_a_forked_child_of_a_process_with_an_offload_adam_neither_hangs_nor_crashes(then):
    r = run_child(f"""
        import os, sys, torch
        from effmem import OffloadAdam
        # small and elementwise: torch's own OpenMP, once used, hangs in a forked child (GNU OpenMP and fork)
        w = torch.nn.Parameter(torch.randn(1 << 12))
        loss = lambda: (w * torch.randn(1 << 12)).square().sum()
        opt = OffloadAdam([w], lr=1e-3, num_threads=2, delay=True)
        loss().backward(); opt.step(); opt.zero_grad()
        pid = os.fork()
        if pid == 0:
            if "{then}" == "close":
                opt.close()
            elif "{then}" == "step":
                try:   # refused at the first use: the gradient hook hands the gradient over in backward
                    loss().backward()
                    opt.step()
                except RuntimeError as e:
                    assert "forked" in str(e), e
                    print("refused", flush=True)
            sys.exit(0)   # interpreter exit: the optimizer is dropped here
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        loss().backward(); opt.step()   # the parent's engine still works
        opt.close()
        print("done")
    """, timeout=60)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    if then == "step":
        assert "refused" in r.stdout


def test_a_forked_child_is_told_how_to_use_an_attached_model():
    """A child forked to save or evaluate the model: attach()'s hooks refuse, naming the way out (opt.close()
    here), which then gives the model with the weights installed before the fork."""
    r = run_child("""
        import os, sys, torch
        from effmem import OffloadAdam
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = OffloadAdam(model.parameters(), lr=1e-3, num_threads=1, async_step=True)
        opt.attach(model)
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward(); opt.step(); opt.zero_grad()
        opt.flush()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        pid = os.fork()
        if pid == 0:
            model.zero_grad()   # no engine call: as before the fork
            try:
                model.state_dict()
            except RuntimeError as e:
                assert "call opt.close() in this process" in str(e), e
                opt.close()
                got = model.state_dict()
                assert all(torch.equal(got[k], v) for k, v in want.items())
                with torch.no_grad():
                    model.eval()(torch.randn(4, 64))
                print("closed", flush=True)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        opt.close()
        print("done")
    """, timeout=60)
    assert r.returncode == 0 and "done" in r.stdout and "closed" in r.stdout, (r.stdout, r.stderr[-2000:])


def test_cpu_kernels_run_in_a_forked_dataloader_worker():
    """A DataLoader worker sets one thread; effmem's pool of the parent (two threads) is not there."""
    r = run_child("""
        import torch
        from effmem import ops
        torch.set_num_threads(2)
        ops.quantize(torch.randn(1 << 20), bits=8)

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                codes, stats = ops.quantize(torch.randn(4096), bits=8)
                return codes.float().sum()

        loader = torch.utils.data.DataLoader(Data(), num_workers=1, multiprocessing_context="fork", timeout=30)
        print(len(list(loader)), "done")
    """)
    assert r.returncode == 0 and "4 done" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_a_group_the_engine_refuses_leaves_the_optimizer_as_it_was():
    m = torch.nn.Linear(8, 8)
    opt = OffloadAdam(m.parameters(), lr=1e-3)
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ValueError, match="params: OffloadAdam offloads the parameters of one device"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, device="meta"))]})
    assert len(opt.param_groups) == 1 and not opt._engine.closed
    after = opt.state_dict()["state"]
    assert all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.close()


@pytest.mark.parametrize("mode", [{}, {"delay": True}])
def test_an_interrupt_among_the_first_step_s_state_entries_leaves_the_optimizer_usable(mode):
    """Ctrl-C (KeyboardInterrupt, raised at any bytecode) inside step()'s making of opt.state's entries, before
    it recorded them: every later step() and state_dict() refused "opt.state was changed by assignment",
    though nothing had touched it, so the run could not even be saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = OffloadAdam(model.parameters(), lr=1e-2, **mode)
    made, real = [], opt._state_of

    def interrupted(i):
        made.append(i)
        if len(made) == 2:
            raise KeyboardInterrupt
        return real(i)
    opt._state_of = interrupted
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    del opt._state_of
    opt.zero_grad()
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(opt.state_dict()["state"]) == 4
    opt.close()


@pytest.mark.parametrize("child", ["nothing", "offload"])
def test_a_forked_child_exits_after_the_parent_ran_the_cpu_kernels_on_two_threads(child):
    """effmem's intra-op pool (a worker thread once a kernel ran with 2 torch threads) was destroyed at a forked
    child's exit: its destructor joined the parent's threads, which the child does not have, and the child hung
    at sys.exit or aborted (a reviewer's repro). The pool is never destroyed at exit now."""
    r = run_child(f"""
        import os, sys, torch, effmem
        torch.set_num_threads(2)
        p = torch.nn.Parameter(torch.zeros(1 << 16))
        p.grad = torch.ones(1 << 16)
        effmem.FusedAdam([p]).step()
        torch.set_num_threads(1)   # torch's own OpenMP pool left unused in the child (it hangs there by itself)
        pid = os.fork()
        if pid == 0:
            if "{child}" == "offload":
                m = torch.nn.Linear(64, 64)
                opt = effmem.OffloadAdam(m.parameters(), lr=1e-3)
                m(torch.randn(4, 64)).sum().backward()
                opt.step()
                opt.close()
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """, timeout=60)
    assert r.returncode == 0 and "child 0" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


def test_a_forked_child_is_told_to_close_before_it_builds_its_own_optimizer():
    """In a forked child a step() with nothing pending returned quietly, and the engine's refusal said to build a
    new optimizer here, which was refused (the parameters still the parent's optimizer's) with advice that named
    no fork (a reviewer's run). Both now name close() here, after which a new optimizer trains."""
    r = run_child("""
        import os, sys, torch
        from effmem import OffloadAdam
        w = torch.nn.Parameter(torch.randn(1 << 12))
        loss = lambda: (w * torch.randn(1 << 12)).square().sum()
        opt = OffloadAdam([w], lr=1e-3, num_threads=1)
        loss().backward(); opt.step(); opt.zero_grad()
        pid = os.fork()
        if pid == 0:
            try:
                opt.step()
                sys.exit(3)
            except RuntimeError as e:
                assert "forked" in str(e) and "opt.close() here" in str(e), e
            try:
                OffloadAdam([w], lr=1e-3)
                sys.exit(4)
            except ValueError as e:
                assert "forked from" in str(e) and "close() here" in str(e), e
            opt.close()
            mine = OffloadAdam([w], lr=1e-3, num_threads=1)
            before = w.detach().clone()
            loss().backward(); mine.step(); mine.close()
            assert not torch.equal(before, w.detach())
            print("trained", flush=True)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        opt.close()
        print("done")
    """, timeout=60)
    assert r.returncode == 0 and "done" in r.stdout and "trained" in r.stdout, (r.returncode, r.stdout,
                                                                                r.stderr[-2000:])
