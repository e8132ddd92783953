"""What effmem plan reads of a Hugging Face config: the presets, a config.json, and the model a config makes on
the meta device, whole or cut to its first n decoder layers (the trace's 1- and 2-layer copies)."""
import difflib
import json
import re
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch import nn

PRESET_DIR = Path(__file__).with_name("presets")
# Config keys that hold the number of decoder layers, by model family.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def preset_names() -> List[str]:
    """The presets effmem plan takes by name (small JSON files of public architecture numbers, no download)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_config(spec: str) -> Tuple[str, dict]:
    """A preset name or a path to a config.json (or a folder holding one) -> (name, config dict)."""
    if not spec.strip():   # Path("") is the current folder
        raise ValueError("model: an empty name; give a preset or a config.json path")
    preset = PRESET_DIR / f"{spec}.json"
    # a file or folder of that name wins ('./llama-7b' holding a config.json is not the preset)
    if preset.is_file() and not Path(spec).exists():
        cfg = json.loads(preset.read_text())
        cfg.pop("_effmem_preset", None)
        return spec, cfg
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"model: {path} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict) or "model_type" not in cfg:
            raise ValueError(f"model: {path} is not a Hugging Face config.json (no \"model_type\" key)")
        # named after its folder, as Hugging Face lays a model out; a config under another name after itself
        return (path.parent.name if path.name == "config.json" else path.stem) or str(path), cfg
    if Path(spec).is_dir():
        raise ValueError(f"model: the folder {spec!r} has no config.json (a Hugging Face model's folder holds one)")
    close = difflib.get_close_matches(spec.lower(), preset_names(), n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"model: {spec!r} is neither a preset ({', '.join(preset_names())}) nor a config.json "
                     f"path{hint}")


def build_model(cfg: dict, num_layers: Optional[int] = None) -> nn.Module:
    """The causal LM of a config dict on the meta device; with num_layers, a copy of its first decoder layers."""
    try:
        import transformers
    except ImportError:
        raise ImportError("effmem plan needs the transformers package to read a Hugging Face config "
                          "(pip install transformers)") from None
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    _check_architectures(cfg.get("architectures"))
    if num_layers is not None:
        full = config_layers(cfg)
        for key in _LAYER_KEYS:
            if cfg.get(key) == full:   # the count, and a second name for it; another key's other meaning stays
                cfg[key] = num_layers
        # per-layer lists (transformers 5's layer_types: sliding or full attention per layer) follow the
        # count, or the config refuses itself; the copy keeps the first layers' pattern
        for key, value in list(cfg.items()):
            if isinstance(value, (list, tuple)) and len(value) == full != num_layers \
                    and _per_layer(model_type, key, transformers):
                cfg[key] = value[:num_layers]
            elif "layer" in key and isinstance(value, dict) and value and all(
                    isinstance(k, str) and k.isdecimal() for k in value):
                # per-layer overrides keyed by layer index (Gemma4's per_layer_config {"05": {...}}): the
                # copy's own layers', or transformers refuses an index past its count
                cfg[key] = {k: v for k, v in value.items() if int(k) < num_layers}
        if model_type == "gpt_neo":   # its pattern, run-length coded: [[["global", "local"], 12]]
            runs = cfg.get("attention_types", transformers.GPTNeoConfig().attention_types)   # or the default's
            cfg.pop("attention_layers", None)   # derived from attention_types by the config
            cfg["attention_types"] = [[[kind], 1] for kind in _expand_runs(runs)[:num_layers]]
    try:
        config = transformers.AutoConfig.for_model(model_type, **cfg)
    except ValueError as e:
        if "Unrecognized model" not in str(e):
            raise _refused(model_type, e) from None
        raise ValueError(f"model: model_type {model_type!r} is not one transformers {transformers.__version__} "
                         "knows (a newer transformers, or a typo in config.json?)") from None
    except Exception as e:   # transformers' own validation (hidden size not a multiple of the heads...)
        raise _refused(model_type, e) from None
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and heads > 0 and kv > 0 and heads % kv:
        # transformers builds it, and its forward fails (each key/value head serves a whole number of queries')
        raise ValueError(f"model: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv}), "
                         "so the model's forward cannot run")
    config.use_cache = False
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):
                raise _refused(model_type, e) from None
            if isinstance(cfg.get("text_config"), dict):
                raise ValueError("model: a multimodal config, its language model under text_config: plan that "
                                 "part (its dict, with its model_type) as the model") from None
            raise ValueError(f"model: effmem plan models causal language models (AutoModelForCausalLM); "
                             f"model_type {model_type!r} has none (an encoder-decoder or encoder-only model?)"
                             ) from None
        except Exception as e:   # a config that builds but not its model (a negative size, a pad id past vocab)
            raise _refused(model_type, e) from None


# the heads of a vocabulary's logits (LlamaForCausalLMEagle3's too; the text generators plan has no causal LM of,
# refused with their model_type); any other For<Head> gives a few numbers per sequence or token (a classifier, QA,
# CTC, a reward model: Qwen2ForProcessRewardModel passed a list of those)
_LM_HEADS = ("CausalLM", "MaskedLM", "ConditionalGeneration", "PreTraining", "VisionText2Text", "TextToText",
             "SpeechToText", "CausalImageModeling")


def _another_head(name: str) -> bool:
    """Whether the architecture's name is For<Head> of a head not a language model's, by its last For and a
    capital; a name without one is a backbone's or an LM head's (BertModel, GPT2LMHeadModel, TransFormerModel)."""
    heads = [m.end() for m in re.finditer(r"For(?=[A-Z])", name)]
    return bool(heads) and not name[heads[-1]:].startswith(_LM_HEADS)


def _check_architectures(names) -> None:
    """A config naming a classifier's head (BertForSequenceClassification) was planned as the causal LM that
    AutoModelForCausalLM builds from its model_type, without a word: another parameter count, and 4 GB of
    logits for a two-label classifier. Refused where every name is such a head; a masked LM's (the same
    vocabulary logits and loss, planned alike), a draft model's or a backbone's name passes."""
    if not (isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names)):
        return
    if all(_another_head(n) for n in names):
        raise ValueError(f"model: the config's architectures name {', '.join(names)}, not a causal language model; "
                         "effmem plan builds a config's AutoModelForCausalLM, whose head and loss are others. "
                         "Build the model (on the meta device) and plan it, with inputs=callable(batch, seq, "
                         "device) -> (args, kwargs) for its training forward")


def _per_layer(model_type: str, key: str, transformers) -> bool:
    """Whether a config list as long as the layer count is one entry per layer, to cut with the count: by the
    config class's defaults, where they hold that key as a list, whether it is as long as their own count
    (Mamba2's time_step_limit, a pair, is not; cut at 2 layers, the model failed on an index); else taken
    as one."""
    if model_type not in _DEFAULT_LENGTHS:
        try:
            defaults = transformers.CONFIG_MAPPING[model_type]().to_dict()
            count = config_layers(defaults)
        except Exception:   # a class without defaults to build, or no count among them
            defaults, count = {}, None
        _DEFAULT_LENGTHS[model_type] = {k: len(v) == count for k, v in defaults.items()
                                        if isinstance(v, (list, tuple)) and v}
    return _DEFAULT_LENGTHS[model_type].get(key, True)


# per model_type: for each list its config class holds by default, whether it is as long as its layer count
_DEFAULT_LENGTHS: dict = {}


def _expand_runs(runs) -> List[str]:
    """GPT-Neo's attention_types, [[kinds, repeats], ...], as one kind per layer."""
    try:
        return [kind for kinds, repeats in runs for _ in range(repeats) for kind in kinds]
    except (TypeError, ValueError):
        raise ValueError(f"model: the config's attention_types is {runs!r}; expected GPT-Neo's "
                         "[[[kind, ...], repeats], ...]") from None


def _refused(model_type: str, e: Exception) -> ValueError:
    """A config transformers refuses, as one line naming the model argument."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = text if len(text) <= 300 else text[:297] + "..."
    return ValueError(f"model: transformers cannot build this {model_type!r} config: {type(e).__name__}: {text}")


def config_layers(cfg: dict) -> int:
    for key in _LAYER_KEYS:
        if key in cfg:
            if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
                raise ValueError(f"model: the config's {key} is {cfg[key]!r}; expected a whole number >= 1 of "
                                 "decoder layers")
            return int(cfg[key])
    if isinstance(cfg.get("text_config"), dict):
        raise ValueError("model: a multimodal config, its language model's layers under text_config: plan that "
                         "part (its dict, with its model_type) as the model")
    other = [k for k in ("num_decoder_layers", "n_layers_decoder", "decoder_layers") if k in cfg]
    raise ValueError(f"model: the config has no layer count effmem plan reads ({' or '.join(_LAYER_KEYS)})"
                     + (f"; it names its count {other[0]!r}, a family effmem plan does not know" if other else ""))
