"""effmem plan's inputs: bad arguments and configs refused by name, sizes read, defaults from the machine, the
garbage collector left as it was."""
import gc
import json

import pytest
import torch

import effmem
from effmem.cli import main
from effmem.plan.machine import parse_bytes

pytest.importorskip("transformers")


@pytest.mark.parametrize("bad,match", [
    (dict(model="no-such-model"), "neither a preset"),
    (dict(gpu_memory="eighty"), "gpu_memory: expected a size"),
    (dict(batch=0), "batch: expected an int >= 1"),
    (dict(batch=3, gpus=2, gpu_memory="80GB"), "do not split evenly"),
    (dict(trainable="nothing_matches_this"), "matches no parameter"),
    # one item of several matching nothing (GPT-2's lm_head is tied to wte): q_proj alone trained before, silently
    (dict(trainable=r"attn\.c_attn,lm_head"), "'lm_head' matches no parameter .* tied to another"),
    (dict(trainable="layers#2:1"), "after '#' expected a:b"),
    (dict(trainable=r"ln_f\.bias#0:1000"), r"selects experts of a stacked parameter.*ln_f.bias has shape \(768,\)"),
    (dict(trainable=r"transformer\.h\.#0:2"), "selects experts of a stacked parameter"),
    (dict(model="mixtral-8x7b", trainable=r"model\.layers\.0\.mlp\.experts\.#0:9"),
     "asks for rows up to 9 of model.layers.0.mlp.experts.gate_up_proj, which has 8"),
    (dict(accum=3, batch=4), "accum: 3 does not divide"),
    (dict(device="tpu"), "device: expected 'cuda' or 'cpu'"),
])
def test_bad_arguments_name_themselves(bad, match):
    kw = dict(model="gpt2", batch=2, seq=64)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        effmem.plan(kw.pop("model"), **kw)
    assert gc.isenabled()   # the collector, paused while planning, is back on after an error too


@pytest.mark.parametrize("change, match", [
    (dict(num_attention_heads=5), "not a multiple of the number of attention heads"),
    (dict(hidden_size="64"), "hidden_size"),
    (dict(intermediate_size=-1), "negative dimension"),
    (dict(pad_token_id=32000), "Padding_idx"),
])
def test_a_config_transformers_refuses_is_one_line_naming_the_model(tmp_path, capsys, change, match):
    """transformers' own validation raised its own exception types (a traceback from the command); now a
    ValueError naming the model argument, and the command's one-line error."""
    cfg = dict(dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256), **change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"model: transformers cannot build this 'llama' config: .*{match}"):
        effmem.plan(str(tmp_path), batch=2, seq=32, device="cpu")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(tmp_path), "--device", "cpu"])
    assert exit_.value.code == 2
    assert "effmem plan: error: model: transformers cannot build" in capsys.readouterr().err


def test_plan_leaves_the_collector_as_it_found_it():
    gc.disable()
    try:
        effmem.plan("gpt2", batch=1, seq=64)
        assert not gc.isenabled()
    finally:
        gc.enable()
    effmem.plan("gpt2", batch=1, seq=64)
    assert gc.isenabled()


def test_defaults_come_from_the_machine():
    p = effmem.plan("gpt2", batch=2, seq=64, device="cuda")  # no GPU here: an 80 GB one is assumed
    assert p.gpu_memory == (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
                            else 80 * 10 ** 9)
    assert p.host_memory > 0 and p.gpus >= 1
    cpu = effmem.plan("gpt2", batch=2, seq=64, device="cpu")
    assert cpu.gpus == 1 and cpu.gpu_memory == cpu.host_memory


def test_parse_bytes_units():
    assert parse_bytes("80GB", "x") == 80 * 10 ** 9 and parse_bytes("80GiB", "x") == 80 << 30
    assert parse_bytes("1.5TB", "x") == 1_500_000_000_000 and parse_bytes(1 << 30, "x") == 1 << 30
    # from Python: gpu_memory=80.0 was 80 bytes (nothing fits, silently); inf an OverflowError
    with pytest.raises(ValueError, match=r"gpu_memory: 80.0 is 80 bytes, less than a MiB: give a size with its unit "
                                         r"\('80GB'\) or bytes \(80e9\)"):
        parse_bytes(80.0, "gpu_memory")
    with pytest.raises(ValueError, match="host_memory: expected a positive, finite size, got inf"):
        parse_bytes(float("inf"), "host_memory")
    assert parse_bytes("80000000000", "x") == 80 * 10 ** 9 and parse_bytes("1e11", "x") == 10 ** 11
    assert parse_bytes("1.5e2MB", "x") == 150 * 10 ** 6   # the exponent the numbers' own error suggests
    with pytest.raises(ValueError, match="'512B' is 512 bytes, less than a MiB: expected a memory size"):
        parse_bytes("512B", "x")   # accepted before, where '512' was refused
    with pytest.raises(ValueError, match=r"gpu_memory: '80' is 80 bytes, less than a MiB: give a unit \(for example "
                                         r"80GB\)"):
        parse_bytes("80", "gpu_memory")   # from the command line: 80GB meant


def test_a_damaged_or_foreign_rates_cache_falls_back_to_the_defaults(monkeypatch, tmp_path):
    """A cache holding a list, or another version's fields, broke every plan with an AttributeError or
    TypeError (and --calibrate, which reads it first, could not repair it)."""
    from effmem.plan import rates
    cache = tmp_path / "plan_rates.json"
    monkeypatch.setattr(rates, "_CACHE", cache)
    cache.write_text("[]")
    assert rates.rates_for("cpu") == rates.CPU_DEFAULT
    cache.write_text(json.dumps({"cpu": {"device": "cpu", "foo": 1}}))
    with pytest.warns(UserWarning, match="plan_rates.json's rates for 'cpu' do not fit this version"):
        assert rates.rates_for("cpu") == rates.CPU_DEFAULT
    # values a hand edit left: a zero rate was a ZeroDivisionError in every plan, a string an unreadable error
    for field, bad in (("matmul_flops", 0), ("memory_bw", "fast"), ("host_op_s", -1.0), ("link_bw", float("nan"))):
        cache.write_text(json.dumps({"cpu": dict(rates.CPU_DEFAULT.as_dict(), **{field: bad})}))
        with pytest.warns(UserWarning, match=f"do not fit this version \\({field} = "):
            assert rates.rates_for("cpu") == rates.CPU_DEFAULT
        effmem.plan("gpt2", batch=2, seq=64, device="cpu")


def test_calibrate_says_where_it_cannot_write(monkeypatch, tmp_path):
    """A cache folder that cannot be made (XDG_CACHE_HOME a file) ended --calibrate in a traceback."""
    from effmem.plan import rates
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(rates, "_CACHE", tmp_path / "file" / "effmem" / "plan_rates.json")
    monkeypatch.setattr(rates, "_host_op_s", lambda device: 1e-5)
    with pytest.raises(OSError, match="calibrate: the rates were measured but cannot be written to .*XDG_CACHE_HOME"):
        rates.calibrate(torch.device("cpu"))


def test_a_gpu_count_plans_gpus_on_a_machine_without_one():
    """The README's `--gpus 8` planned 8 CPU processes sharing this machine's memory where it has no GPU."""
    p = effmem.plan("gpt2", batch=8, seq=64, gpus=8)
    assert p.device == "cuda" and p.gpus == 8
    assert effmem.plan("gpt2", batch=8, seq=64, gpus=2, device="cpu").device == "cpu"


@pytest.mark.parametrize("flag", ["--gpu-memory", "--host-memory"])
def test_a_size_past_floats_range_is_refused_by_name(capsys, flag):
    """'1e400GB' read as infinity bytes: an OverflowError traceback (exit code 1) where 'infGB' got the
    usual one-line error."""
    what = flag[2:].replace("-", "_")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "llama-7b", flag, "1e400GB"])
    assert exit_.value.code == 2
    assert f"effmem plan: error: {flag}: expected a size such as 80GB" in capsys.readouterr().err   # the flag
    with pytest.raises(SystemExit):
        main(["plan", "gpt2", "--batch", "0"])
    assert "error: --batch: expected an int >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"{what}: expected a size such as 80GB.*'1e400GB'"):
        effmem.plan("llama-7b", **{what: "1e400GB"})
    with pytest.raises(ValueError, match=f"{what}: expected a positive, finite size"):
        parse_bytes(10 ** 400, what)   # an int float() cannot hold: math.isfinite raised OverflowError
    with pytest.raises(ValueError, match=f"{what}: expected a positive size, got '0'"):
        parse_bytes("0", what)   # not "a size such as 80GB, 80GiB or a number of bytes": 0 is a number of bytes


def test_gpu_memory_capped_by_the_host_on_a_cpu_says_so(capsys):
    """--device cpu --gpu-memory 80GB planned for the host's 25 GB without a word."""
    p = effmem.plan("gpt2", batch=2, seq=64, device="cpu", gpu_memory="80GB", host_memory="16GB", gpus=2)
    assert p.gpu_memory == 8 * 10 ** 9
    note = ("gpu_memory: 80 GB given, but on device cpu a rank has the host memory's share: planned for 8 GB "
            "(host_memory 16 GB / 2 ranks)")
    assert note in p.notes and note in p.as_dict()["notes"]
    main(["plan", "gpt2", "--batch", "2", "--seq", "64", "--device", "cpu", "--gpu-memory", "80GB",
          "--host-memory", "16GB"])
    assert "note: gpu_memory: 80 GB given, but on device cpu a rank has the host memory's share: planned for " \
           "16 GB (host_memory 16 GB)" in capsys.readouterr().out
    within = effmem.plan("gpt2", batch=2, seq=64, device="cpu", gpu_memory="4GB", host_memory="16GB")
    assert within.gpu_memory == 4 * 10 ** 9 and not any("gpu_memory" in n for n in within.notes)


@pytest.mark.parametrize("bad, error, match", [
    (dict(headroom="0.1"), ValueError, r"headroom: expected a fraction in \[0, 1\), got '0.1'"),
    (dict(headroom=True), ValueError, r"headroom: expected a fraction in \[0, 1\), got True"),
    (dict(rates="fast"), TypeError, "rates: expected a Rates .*got str"),
    (dict(clipping="no"), TypeError, "clipping: expected True or False, got 'no'"),
    (dict(clipping=0), TypeError, "clipping: expected True or False, got 0"),
    # inputs=5 made every trace fail, and the plan fell back to the closed form without refusing it
    (dict(inputs=5), TypeError, r"inputs: expected a callable\(batch, seq, device\) -> \(args, kwargs\), got int"),
])
def test_keywords_of_the_wrong_type_name_themselves(bad, error, match):
    with pytest.raises(error, match=match):
        effmem.plan("gpt2", batch=2, seq=64, **bad)
    assert gc.isenabled()


@pytest.mark.parametrize("index, accumulation, match", [
    (2, 2, r"index: expected a micro-batch in 0..1 \(accumulation = 2\), got 2"),
    (-1, 2, "index: expected an int >= 0, got -1"),
    (0, 0, "accumulation: expected an int >= 1, got 0"),
    (0, 2.0, "accumulation: expected an int >= 1, got 2.0"),
])
def test_micro_batch_refuses_an_index_outside_the_step(index, accumulation, match):
    from effmem.plan import Plan
    with pytest.raises(ValueError, match=match):
        Plan.micro_batch(None, index, accumulation)
    Plan.micro_batch(None, 1, 2)   # the last of two: a plain context


def test_apply_refuses_a_model_other_than_the_planned_one():
    """plan.apply prepared any module: an nn.Linear, a Llama of another size, for memory the plan never counted."""
    import transformers
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    p = effmem.plan(cfg, batch=2, seq=32, device="cpu", host_memory="8GB")

    def llama(**change):
        c = dict(cfg, **change)
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(c.pop("model_type"),
                                                                                                **c))
    with pytest.raises(ValueError, match=rf"model: Linear has 4,160 parameters, the plan's llama {p.params:,}"):
        p.apply(torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"model: LlamaForCausalLM has [0-9,]+ parameters, the plan's llama"):
        p.apply(llama(num_hidden_layers=3))
    p.apply(llama(vocab_size=260))   # a vocabulary resized for added tokens: still that model (within 5%)
    same = llama()
    for q in same.model.embed_tokens.parameters():
        q.requires_grad_(False)   # frozen by the user: still the planned model
    # an optimizer argument the candidate sets was "got multiple values for keyword argument 'state_bits'"
    with pytest.raises(ValueError, match=r"state_bits: the candidate's to choose"):
        p.apply(llama(), state_bits=8)
    assert p.pick.config.optimizer == "gpu"   # FusedAdam: OffloadAdam's modes are none of its options
    with pytest.raises(ValueError, match=r"async_step, device_state: OffloadAdam's, not options of the candidate's "
                                         r"FusedAdam"):
        p.apply(llama(), device_state=0, async_step=True)
    model, opt = p.apply(same, betas=(0.8, 0.9))
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_numpy_integers_are_taken_as_ints():
    import numpy as np
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)
    p = effmem.plan(cfg, batch=np.int64(4), seq=np.int32(32), accum=np.int64(2), device="cpu")
    q = effmem.plan(cfg, batch=4, seq=32, accum=2, device="cpu")
    mine, theirs = p.as_dict(), q.as_dict()
    mine.pop("plan_seconds"), theirs.pop("plan_seconds")
    assert p.best == q.best and json.dumps(mine) == json.dumps(theirs)   # np.int64 in it: "not JSON serializable"


def test_a_multimodal_config_is_told_to_plan_its_text_config():
    llava = dict(model_type="llava", text_config=dict(model_type="llama", hidden_size=64, num_hidden_layers=2),
                 vision_config=dict(model_type="clip_vision_model"))
    with pytest.raises(ValueError, match="a multimodal config, its language model under text_config"):
        effmem.plan(llava, batch=1, seq=16, device="cpu")


def test_apply_refuses_a_meta_model_and_a_gpu_plan_without_a_gpu_before_changing_anything():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"):
        planned = LlamaForCausalLM(config)
    p = effmem.plan(planned, batch=4, seq=32, device="cpu", trainable=r"layers\.1\.")
    with pytest.raises(ValueError, match=r"model: model\.\S+ is on the meta device \(no values"):
        p.apply(planned)   # was torch's "Cannot copy out of meta tensor"
    assert all(t.requires_grad for t in planned.parameters())
    if not torch.cuda.is_available():
        real = LlamaForCausalLM(config)
        on_gpu = effmem.plan(real, batch=4, seq=32, gpu_memory="24GB", trainable=r"layers\.1\.")
        with pytest.raises(RuntimeError, match="plan: made for a CUDA GPU .* this process sees none"):
            on_gpu.apply(real)   # was "Found no NVIDIA driver", after freezing parameters
        assert all(t.requires_grad for t in real.parameters())
