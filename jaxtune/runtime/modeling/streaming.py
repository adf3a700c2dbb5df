"""Load a Hugging Face causal LM from its safetensors one decoder layer at a time, so that host
memory never holds more of the checkpoint than the model being built plus one layer.

The model is made on the meta device, as `from_pretrained` makes it, and each group of
checkpoint tensors (everything under one decoder layer, or one tensor outside the layers) is
read with `safetensors`' pread backend (no file mapped into memory), renamed, cast and set by
transformers' own `convert_and_load_state_dict_in_model`; transformers' `_finalize_model_loading`
then computes the buffers no checkpoint holds (rotary `inv_freq`) and ties the embeddings. What
comes out is `from_pretrained`'s model, tensor for tensor.

Between groups, `take(layer, linear)` sees each `nn.Linear` whose weight has just arrived: it may
keep what it needs of the weight (its quantized codes) and return True, and the weight is then
dropped for a placeholder of its shape and dtype that holds one value (`placeholder`): a frozen
base quantized on the way never has all its float weights in memory at once. Whatever the
loader cannot read this way (custom modeling code, no safetensors, keys transformers does not
map onto the model) it loads with `from_pretrained`, says why in the log, and calls `take` after.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import json
import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger(__name__)

Take = Callable[[str, torch.nn.Linear], bool]
PROGRESS_SECONDS = 10.0  # a load still reading says so this often
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class NotStreamable(Exception):
    """Why a checkpoint is loaded whole instead."""


def load_model(
    name: str, revision: str | None, trust_remote_code: bool = False, dtype: str = "float32", take: Take | None = None
) -> PreTrainedModel:
    """The model `from_pretrained(name, dtype=dtype, attn_implementation="eager")` gives, in eval
    mode, loaded a decoder layer at a time; each linear layer that `take` takes holds a placeholder weight.
    It says what it reads every `PROGRESS_SECONDS`, and once read, how long it took (INFO)."""
    started = time.perf_counter()
    try:
        model = _stream(name, revision, trust_remote_code, getattr(torch, dtype), take)
    except NotStreamable as why:
        log.info("loading %s whole with from_pretrained: %s", name, why)
        model = load_whole(name, revision, trust_remote_code, dtype)
        if take is not None:
            for layer, linear in list(_linears(model).items()):
                if take(layer, linear):
                    _drop_weight(linear)
    seconds = time.perf_counter() - started
    log.info("read %s in %.1f s", name, seconds, extra={"phase": "read", "seconds": seconds})
    return model.eval()


def load_whole(name: str, revision: str | None, trust_remote_code: bool, dtype: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(
        name,
        revision=revision,
        dtype=getattr(torch, dtype),
        attn_implementation="eager",
        trust_remote_code=trust_remote_code,
    )


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.nn.Parameter:
    """A frozen parameter of `shape` and `dtype` that holds a single zero (every element is the
    same one): what a layer keeps of a weight it no longer needs, until its replacement arrives."""
    value = torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(shape), requires_grad=False)
    value._is_hf_initialized = True  # transformers' weight init must not write to it
    return value


def is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 1 and all(stride == 0 for stride in tensor.stride())


def _drop_weight(linear: torch.nn.Linear) -> None:
    linear.weight = placeholder(tuple(linear.weight.shape), linear.weight.dtype)


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: sub for name, sub in model.named_modules() if type(sub) is torch.nn.Linear}


def _stream(
    name: str, revision: str | None, trust_remote_code: bool, dtype: torch.dtype, take: Take | None
) -> PreTrainedModel:
    from transformers import GenerationConfig
    from transformers.models.auto.auto_factory import _get_model_class

    config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    if AutoModelForCausalLM.__name__ in (getattr(config, "auto_map", None) or {}):
        raise NotStreamable("the model's own modeling code (trust_remote_code) builds it")
    if getattr(config, "quantization_config", None) is not None:
        raise NotStreamable("the checkpoint is quantized already (config.quantization_config)")
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise NotStreamable(f"no causal LM class for {type(config).__name__}")
    files = _checkpoint_files(name, revision)
    model_class = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    try:
        model, load_config = _skeleton(model_class, config, name, dtype, files)
    except (ImportError, AttributeError, TypeError) as error:  # transformers' loading internals changed
        raise NotStreamable(f"this transformers' loader cannot be driven a layer at a time ({error!r})") from None

    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.utils import logging as hf_logging

    linears = _linears(model)
    info = None
    with ExitStack() as stack:
        if hf_logging.is_progress_bar_enabled():  # one bar a layer says nothing: none
            hf_logging.disable_progress_bar()
            stack.callback(hf_logging.enable_progress_bar)
        # Read in this thread: tensors read by worker threads go to their own malloc arenas, which
        # each keep a layer's worth of freed memory.
        stack.enter_context(_environ(HF_DEACTIVATE_ASYNC_LOAD="1"))
        # What exists before the load (the imported libraries' objects, the caller's) is frozen out of the
        # collections each layer runs, so that each looks at the load's own objects alone: a full
        # collection of the whole heap took 0.7 s a layer in a process holding PyTorch, transformers and JAX.
        gc.freeze()
        stack.callback(gc.unfreeze)
        tensors = {}
        for file in files:
            handle = stack.enter_context(_open(file))
            tensors.update(dict.fromkeys(handle.keys(), handle))
        groups = _groups(tensors)
        log.info("reading %s: %d groups of tensors from %d files", name, len(groups), len(files))
        started = reported = time.perf_counter()
        for index, group in enumerate(groups):
            if time.perf_counter() - reported >= PROGRESS_SECONDS:
                reported = time.perf_counter()
                log.info("reading %s: group %d of %d, %.0f s so far", name, index + 1, len(groups), reported - started)
            part, _ = convert_and_load_state_dict_in_model(
                model=model, state_dict={key: tensors[key].get_slice(key) for key in group}, load_config=load_config
            )
            info = part if info is None else _merged(info, part)
            if take is not None:
                for layer, linear in list(linears.items()):
                    if linear.weight.device.type != "meta":
                        del linears[layer]
                        if take(layer, linear):
                            _drop_weight(linear)
            _give_back_freed_memory()
    if info is None:
        raise NotStreamable("the checkpoint holds no tensors")
    model._weight_conversions = [conversion for conversion in load_config.weight_mapping if conversion.was_used()]
    unmapped = (info.missing_keys - set(getattr(model, "all_tied_weights_keys", {}))) | {
        key for key, *_ in info.mismatched_keys
    }
    if unmapped or info.conversion_errors:
        raise NotStreamable(
            f"checkpoint keys do not map onto the model: missing or mismatched {sorted(unmapped)[:5]}, "
            f"conversion errors {sorted(info.conversion_errors)[:5]}"
        )
    model_class._finalize_model_loading(model, load_config, info)
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(name, revision=revision)
        except OSError:  # none saved: keep the one made from the model's config, as from_pretrained does
            pass
    return model


def _skeleton(model_class, config, name: str, dtype: torch.dtype, files: list[str]):
    """The model on the meta device as `from_pretrained` builds it, and transformers' loading
    settings for it (its dtype plan and checkpoint key conversions)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig, _get_dtype
    from transformers.utils.generic import ContextManagers

    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    config, dtype = _get_dtype(dtype, files, config, None, None, True)
    config.name_or_path = name
    with ContextManagers(model_class.get_init_context(dtype, False, False, False, config)):
        model = model_class(config)
    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=name,
        dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype),
        weight_mapping=get_model_conversion_mapping(model),
    )
    return model, load_config


def _give_back_freed_memory() -> None:
    """Free a layer's float weights now: transformers' loading leaves them in reference cycles,
    which Python frees only when its collector next runs; and glibc's malloc keeps freed memory
    for reuse, counted as the process's: hand its whole free pages back to the system (Linux)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextmanager
def _environ(**values: str):
    former = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in former.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _checkpoint_files(name: str, revision: str | None) -> list[str]:
    """The safetensors files of a folder or hub repository: the shards its index lists, or its one file."""
    from transformers.utils import cached_file

    index = cached_file(name, INDEX, revision=revision, _raise_exceptions_for_missing_entries=False)
    if index is not None:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [cached_file(name, shard, revision=revision) for shard in shards]
    single = cached_file(name, SINGLE, revision=revision, _raise_exceptions_for_missing_entries=False)
    if single is None:
        raise NotStreamable(f"no {SINGLE} or {INDEX} (a .bin checkpoint, or a variant)")
    return [single]


def _open(file: str):
    """A safetensors file read by pread: a tensor read is a copy in ordinary memory, freed with it,
    where a mapped file's pages would stay counted in the process's memory until it is closed."""
    from safetensors import safe_open

    return safe_open(file, framework="pt", backend="pread")


def _groups(keys) -> list[list[str]]:
    """Checkpoint keys in groups loaded together: all those of one decoder layer (the key up to its
    first number: `model.layers.3`, `transformer.h.3`), each other key alone."""
    from transformers.core_model_loading import dot_natural_key

    groups: dict[str, list[str]] = {}
    for key in sorted(keys, key=dot_natural_key):
        match = re.match(r"(.*?\.\d+)\.", key)
        groups.setdefault(match.group(1) if match else key, []).append(key)
    return list(groups.values())


def _merged(info, part):
    """Two groups' loading reports as one: a key is missing when no group loaded it."""
    return replace(
        info,
        missing_keys=info.missing_keys & part.missing_keys,
        unexpected_keys=info.unexpected_keys | part.unexpected_keys,
        mismatched_keys=info.mismatched_keys | part.mismatched_keys,
        error_msgs=info.error_msgs + part.error_msgs,
        conversion_errors={**info.conversion_errors, **part.conversion_errors},
        skipped_pp_keys=info.skipped_pp_keys | part.skipped_pp_keys,
    )
