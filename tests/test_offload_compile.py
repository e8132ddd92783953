"""OffloadAdam inside torch.compile: its step and its gradient hook run eagerly, as host work."""
import pytest
import torch

from effmem import OffloadAdam
from test_optim_journeys import _close, _linear


@pytest.mark.parametrize("mode", [{}, {"delay": True}, {"state_bits": 8}])
def test_offload_step_under_torch_compile_runs_as_eager(mode):
    """torch.compile(opt.step): the second compiled call refused with "opt.state was changed by assignment"
    (dynamo did not replay the optimizer's record of its state); the step now runs eagerly inside."""
    runs = []
    for compiled in (False, True):
        m = _linear(torch.float32)
        opt = OffloadAdam(m.parameters(), lr=1e-2, **mode)
        step = torch.compile(opt.step) if compiled else opt.step
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
        for _ in range(3):
            m(x).square().mean().backward()
            step()
            opt.zero_grad()
        opt.flush()
        runs.append([p.detach().clone() for p in m.parameters()])
        _close(opt)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_compiled_training_step_does_not_compile_the_gradient_hook():
    """torch.compile of loss.backward(); opt.step(): dynamo traced OffloadAdam's gradient hook each time
    backward called it, compiled it again at every call (its guards held the gradient handed off) until
    its recompile limit, with a warning, seconds a step on a 4-parameter model. It is host work: skipped."""
    from torch._dynamo.utils import counters
    m = _linear(torch.float32)
    opt = OffloadAdam(m.parameters(), lr=1e-2)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))

    @torch.compile(backend="eager")
    def step():
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch._dynamo.reset()
    counters.clear()
    for _ in range(4):
        step()
    _close(opt)
    # what dynamo traced and broke on: the hook's frames (resumed after graph breaks at the engine's calls)
    seen = list(counters["resumes"]) + list(counters["graph_break"])
    assert not [k for k in seen if "_hand_off" in k or "_send" in k or "grad_ready" in k], seen
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_a_model_of_the_same_class_compiled_after_attach_does_not_lend_its_code():
    """A teacher of the student's class, compiled and run after the student was attached (async_step): dynamo does
    not guard on module hooks by default, so the student ran the teacher's code, without the hooks that install
    its new weights, and backward refused (a reviewer's run). Code compiled after effmem adds hooks now guards
    on them; the compiled student steps as the eager one."""
    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    runs = []
    for compiled in (False, True):
        student, teacher = net(0), net(1)
        opt = OffloadAdam(student.parameters(), lr=1e-2, async_step=True)
        opt.attach(student)
        run_student = torch.compile(student, backend="aot_eager") if compiled else student
        run_teacher = torch.compile(teacher, backend="aot_eager") if compiled else teacher
        run_teacher(x).square().mean().backward()
        for _ in range(3):
            run_student(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        runs.append([p.detach().clone() for p in student.parameters()])
        _close(opt)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
