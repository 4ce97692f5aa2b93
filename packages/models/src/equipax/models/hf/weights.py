"""Hugging Face weights into a `TransformerLM` and out of it, and the logit-parity gate.

`load_lm` builds the model's arrays directly in their shardings: each device's shard is read from
the safetensors byte ranges it covers (`jax.make_array_from_callback` + `TensorMap.read`), so no
process holds more than its own shards plus one read chunk. `hf_tensors` gives the Hugging Face
tensors of a model one at a time, fetching to the host only the part of a (sharded) array that
holds each, whatever the stack's layout (scanned, unrolled, pipelined). `parity_kl` compares the
model's logits with the numpy reference (`equipax.models.hf.reference`) on fixed tokens.
"""

import copy
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from equipax.core.nn.moe import MoEFeedForward
from equipax.core.trees import flat_arrays
from equipax.models.configs import LMConfig
from equipax.models.hf.params import ROUTER_BIAS, TensorMap, hf_names, locate, tensor_maps
from equipax.models.hf.reference import logit_kl, reference_logits
from equipax.models.hf.safetensors import (
    DTYPES,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointFormatError,
    HFCheckpoint,
    write_safetensors,
)
from equipax.models.lm import TransformerLM

__all__ = [
    "GATE_TOKENS",
    "gate_ids",
    "hf_tensors",
    "load_lm",
    "model_maps",
    "model_logits",
    "dropless",
    "parity_kl",
    "write_hf_weights",
]

# Positions of the parity gate: one row of fixed pseudo-random ids (at most max_seq_len).
GATE_TOKENS = 32
# Tensors a checkpoint may hold that are not parameters (older rotary buffers).
_NOT_PARAMETERS = ("rotary_emb.inv_freq",)


def _abstract(cfg: LMConfig) -> TransformerLM:
    return eqx.filter_eval_shape(lambda: TransformerLM(cfg, key=jax.random.key(0)))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def model_maps(cfg: LMConfig) -> dict[str, TensorMap]:
    """The `TensorMap` of each array of a `TransformerLM` of `cfg`, by checkpoint path."""
    return tensor_maps(cfg, {k: tuple(v.shape) for k, v in flat_arrays(_abstract(cfg)).items()})


def _check_tensors(ckpt: HFCheckpoint, cfg: LMConfig, maps: dict[str, TensorMap]) -> None:
    """CheckpointFormatError naming the file and tensor: missing, extra, wrong shape or dtype."""
    wanted = {n: maps[p].hf_shape for n, (p, _) in locate(maps).items()}
    where = ckpt.directory
    missing = [n for n in wanted if n not in ckpt]
    if missing:
        raise CheckpointFormatError(
            f"{where} lacks {len(missing)} tensor(s) its config.json implies, e.g. {', '.join(missing[:3])}: the "
            "weights are of another model than the config (or a checkpoint of another family)."
        )
    for name, shape in wanted.items():
        info = ckpt.info(name)
        if info.shape != shape:
            raise CheckpointFormatError(
                f"{ckpt.file_of(name).path}: tensor {name!r} has shape {list(info.shape)}, but config.json implies "
                f"{list(shape)}: the weights and the config describe different models."
            )
    extra = [n for n in ckpt.names() if n not in wanted and not n.endswith(_NOT_PARAMETERS)]
    if extra == ["lm_head.weight"] and cfg.tie_embeddings:
        head, table = ckpt.read("lm_head.weight"), ckpt.read("model.embed_tokens.weight")
        if np.array_equal(head.view(np.uint8), table.view(np.uint8)):
            return  # a tied head saved anyway: the same numbers
    if extra:
        raise CheckpointFormatError(
            f"{where} holds {len(extra)} tensor(s) this model has no place for, e.g. {', '.join(extra[:3])} "
            f"(tie_word_embeddings={cfg.tie_embeddings}); a checkpoint of another architecture would load wrong."
        )


def load_lm(
    directory: str | os.PathLike[str], cfg: LMConfig, shardings: Any = None, *, dtype: Any = jnp.float32
) -> TransformerLM:
    """The `TransformerLM` of `cfg` with the weights of a Hugging Face model directory.

    Arguments:
        directory: safetensors weights (one file, or an index and its shards).
        cfg: the model (`lm_config_from_hf` of the directory's config.json, or an experiment's
            model with the same architecture).
        shardings: a pytree of `jax.sharding.Sharding`s matching the model's arrays (e.g. the train
            state's `.model`); None = the first local device.
        dtype: the parameters' dtype (float32: a bf16 or f16 checkpoint converts exactly).

    Returns:
        The model; each array built shard by shard from the byte ranges its devices own.

    Raises:
        CheckpointFormatError: missing shards or tensors, a tensor of the wrong shape or dtype.
    """
    ckpt = HFCheckpoint(directory)
    maps = model_maps(cfg)
    _check_tensors(ckpt, cfg, maps)
    abstract = _abstract(cfg)
    arrays, static = eqx.partition(abstract, _is_array)
    paths, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    if shardings is None:
        placed = [SingleDeviceSharding(jax.local_devices()[0])] * len(paths)
    else:
        placed = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
        if len(placed) != len(paths):
            raise ValueError(f"{len(placed)} shardings for a model of {len(paths)} arrays")
    out_dtype = np.dtype(dtype)

    def build(path: Any, leaf: Any, sharding: Sharding) -> jax.Array:
        if jax.tree_util.keystr(path).endswith(ROUTER_BIAS):  # not in the checkpoint: balancing starts at 0
            return jax.device_put(np.zeros(leaf.shape, out_dtype), sharding)
        tmap = maps[jax.tree_util.keystr(path)]
        return jax.make_array_from_callback(
            tuple(leaf.shape), sharding, lambda index: tmap.read(ckpt, tuple(index or ())).astype(out_dtype)
        )

    leaves = [build(p, leaf, s) for (p, leaf), s in zip(paths, placed, strict=True)]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)


def hf_tensors(model: TransformerLM, *, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
    """The model's weights as Hugging Face tensors, in export order, one at a time.

    Arguments:
        model: the model (any stack layout, any sharding).
        dtype: "float32", "bfloat16" or "float16": the tensors' dtype.

    Yields:
        `(name, tensor)`; only the part of a sharded array that holds the tensor reaches the host.
    """
    out = {"float32": DTYPES["F32"], "bfloat16": DTYPES["BF16"], "float16": DTYPES["F16"]}[dtype]
    flat = flat_arrays(model)
    maps = tensor_maps(model.cfg, {k: tuple(v.shape) for k, v in flat.items()})
    where = locate(maps)
    for name in hf_names(model.cfg):
        path, pos = where[name]
        tmap = maps[path]
        part = jax.device_get(flat[path][tmap.index_of(pos)])
        yield name, tmap.to_hf(np.asarray(part)).astype(out)


def write_hf_weights(
    directory: str | os.PathLike[str], tensors: Iterable[tuple[str, np.ndarray]], *, shard_bytes: int
) -> list[str]:
    """Write tensors as safetensors files with `{"format": "pt"}` metadata, as `save_pretrained` does:
    `model.safetensors` when they fit in `shard_bytes`, else `model-0000k-of-0000N.safetensors` shards
    (whole tensors, in order) and `model.safetensors.index.json`.

    Arguments:
        directory: an existing, empty directory (the caller renames it into place).
        tensors: `(name, array)` pairs, consumed one shard at a time.
        shard_bytes: the most bytes of tensors per file (a larger tensor gets a file of its own).

    Returns:
        The files written.
    """
    directory = Path(directory)
    shards: list[list[str]] = []
    weight_map: dict[str, int] = {}
    total = 0
    pending: dict[str, np.ndarray] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            write_safetensors(directory / f".shard-{len(shards)}", pending, {"format": "pt"})
            shards.append(list(pending))
            pending, size = {}, 0

    for name, array in tensors:
        if pending and size + array.nbytes > shard_bytes:
            flush()
        pending[name] = array
        weight_map[name] = len(shards)
        size += array.nbytes
        total += array.nbytes
    flush()
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for k, file in enumerate(files):
        os.replace(directory / f".shard-{k}", directory / file)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: files[v] for k, v in weight_map.items()}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_FILE)
    return files


def gate_ids(cfg: LMConfig, tokens: int = GATE_TOKENS) -> np.ndarray:
    """The parity gate's token ids: one row of `min(tokens, max_seq_len)` fixed pseudo-random ids."""
    rng = np.random.default_rng(0)
    return rng.integers(0, cfg.vocab_size, (1, min(tokens, cfg.max_seq_len))).astype(np.int32)


@eqx.filter_jit
def _logits(model: TransformerLM, ids: jax.Array) -> jax.Array:
    return model(ids)


def model_logits(model: TransformerLM, ids: np.ndarray) -> np.ndarray:
    """The model's float32 logits of `ids` `[batch seq]`, on the host."""
    return np.asarray(jax.device_get(_logits(model, jnp.asarray(ids))))


def dropless(model: TransformerLM) -> TransformerLM:
    """The same model with every mixture-of-experts layer dispatching dropless, as transformers
    computes: a capacity factor only bounds a training step's buffers (it drops the tokens over
    capacity), so the weights are checked without it."""

    def one(x: Any) -> Any:
        if isinstance(x, MoEFeedForward) and x.capacity_factor is not None:
            x = copy.copy(x)
            object.__setattr__(x, "capacity_factor", None)  # a static field of a frozen module
        return x

    return jax.tree.map(one, model, is_leaf=lambda x: isinstance(x, MoEFeedForward))


def parity_kl(model: TransformerLM, directory: str | os.PathLike[str], ids: np.ndarray | None = None) -> float:
    """KL between the numpy reference's next-token distributions of the Hugging Face directory
    and the model's (`dropless`), averaged over the positions of `ids` (default `gate_ids`)."""
    ids = gate_ids(model.cfg) if ids is None else ids
    return logit_kl(reference_logits(directory, ids), model_logits(dropless(model), ids))
