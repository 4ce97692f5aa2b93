"""The language-model family: LMTask, token inputs (Shakespeare, synthetic, C4), the final sample."""

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from equipax.core.config_checks import bubble_fraction, num_microbatches
from equipax.core.mesh_config import FSDP, TENSOR
from equipax.launch.configs.experiment import ExperimentConfig, as_lm
from equipax.launch.store.storage import AnyPath
from equipax.launch.tasks import Family, Inputs

if TYPE_CHECKING:  # JAX and the models load when a run builds its Task, not for `launch show`
    from jax.sharding import Mesh

    from equipax.core.step import TrainState
    from equipax.models.lm_task import LMTask

__all__ = ["continue_ids", "FAMILY", "flops_per_token", "LMFamily", "UNIT"]

UNIT = "tokens"


def flops_per_token(cfg: ExperimentConfig) -> dict[str, float]:
    """Model FLOPs per token of either LM family (`training`, `attention`, `remat`, ...)."""
    lm = as_lm(cfg)
    return lm.model.flops_per_token(seq_len=lm.data.seq_len)


def _pipeline_numbers(cfg: ExperimentConfig, params: dict[str, int]) -> dict[str, Any]:
    """Stages, microbatches, the bubble and one stage's share of the state (pipelined models only).

    `stage_state_bytes_per_device` is analytic: the stage's layers plus the (tied) embedding, in
    float32 parameters and two Adam moments (12 bytes each), split over fsdp x tensor.
    """
    tcfg = cfg.model.transformer  # pyright: ignore[reportAttributeAccessIssue]
    stages = tcfg.pipeline_stages
    micro = num_microbatches(tcfg, cfg.global_batch_size)
    stage_params = params["per_layer"] * tcfg.num_layers // stages
    shards = cfg.mesh.axis_size(FSDP, TENSOR)
    return {
        "pipeline_stages": stages,
        "pipeline_schedule": tcfg.pipeline_schedule,
        "pipeline_repeats": tcfg.pipeline_repeats,
        "pipeline_microbatches": micro,
        "pipeline_microbatch_size": cfg.global_batch_size // micro,
        "pipeline_bubble_fraction": round(bubble_fraction(stages, micro, tcfg.pipeline_repeats), 4),
        "params_per_stage": stage_params,
        "stage_state_bytes_per_device": 12 * (stage_params + params["embedding"]) // shards,
    }


def continue_ids(model: Any, prompt: list[int], num_tokens: int, *, temperature: float, key: Any) -> list[int]:
    """`prompt` followed by `num_tokens` tokens from `equipax.models.decode.decode` (KV cache).

    While prompt and sample fit in the model's `max_seq_len` this is one `decode` call, and greedy
    decoding gives `equipax.models.lm.generate`'s tokens (sampling uses its key schedule too).
    A longer sample continues in rounds: each round's prompt is the last `max_seq_len // 2`
    tokens (`generate` instead slides its window by one token, recomputing it every step), so
    every token still sees at least half a window of context, at 2 compiled programs.
    """
    import jax
    import jax.numpy as jnp

    from equipax.models.decode import decode

    max_len = model.cfg.max_seq_len
    half = max(max_len // 2, 1)
    ids = list(prompt) if len(prompt) < max_len else list(prompt[-half:])
    generated: list[int] = []
    rounds = 0
    while len(generated) < num_tokens:
        context = (list(prompt) + generated)[-half:] if rounds else ids
        room = max_len - len(context)
        sub = None if key is None or temperature == 0 else (jax.random.fold_in(key, rounds) if rounds else key)
        tokens, _ = decode(
            model,
            jnp.asarray([context], jnp.int32),
            jnp.asarray([len(context)], jnp.int32),
            max_new_tokens=room if rounds else min(room, num_tokens),
            temperature=temperature,
            key=sub,
        )
        generated += jax.device_get(tokens)[0].tolist()[: num_tokens - len(generated)]
        rounds += 1
    return list(prompt) + generated


def _file_digest(path: AnyPath) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


class LMFamily(Family):
    """The language-model family: `LMTask` on token inputs, the run's final sample."""

    UNIT: ClassVar[str] = UNIT

    def numbers(self, cfg: ExperimentConfig) -> dict[str, Any]:
        """Parameters, FLOPs and tokens, analytically (no devices, no tracing)."""
        model, data = as_lm(cfg).model, as_lm(cfg).data
        params = model.param_counts()
        flops = flops_per_token(cfg)
        tokens_per_step = cfg.global_batch_size * data.seq_len
        out = {
            "params_total": params["total"],
            "params_active": params["active"],
            "params_embedding": params["embedding"],
            "params_per_layer": params["per_layer"],
            "global_batch": cfg.global_batch_size,
            "tokens_per_step": tokens_per_step,
            "total_tokens": tokens_per_step * cfg.num_steps,
            "model_flops_per_token": flops["training"],
            "model_flops_per_step": flops["training"] * tokens_per_step,
            "devices_required": cfg.mesh.num_devices,
            "mesh_shape": list(cfg.mesh.shape),
        }
        return out | _pipeline_numbers(cfg, params) if model.pipeline_stages > 1 else out

    def units_per_example(self, cfg: ExperimentConfig) -> int:
        """Tokens per example (throughput is reported in tokens/s)."""
        return as_lm(cfg).data.seq_len

    def make_task(self, cfg: ExperimentConfig, mesh: "Mesh | None") -> "LMTask":
        """The LMTask of `cfg` on `mesh`, its attention kernel resolved for the mesh, the training
        sequence length and the model's dtype (`equipax.core.nn.fused_attention.with_resolved_attention`:
        `attention_impl="auto"` decided here, once; what knobs.txt and compile.json record)."""
        import dataclasses

        from equipax.core.nn.fused_attention import with_resolved_attention
        from equipax.models.lm_task import LMTask

        lm = as_lm(cfg)
        seq_len = lm.data.seq_len
        transformer = with_resolved_attention(lm.model.transformer, mesh, seq_len=seq_len, dtype=lm.model.dtype)
        model = (
            lm.model if transformer is lm.model.transformer else dataclasses.replace(lm.model, transformer=transformer)
        )
        return LMTask(model, seq_len, packed=lm.data.packing, mesh=mesh)

    def build_inputs(
        self, cfg: ExperimentConfig, job_dir: AnyPath, *, mesh: "Mesh", log: Callable[[str], object]
    ) -> Inputs:
        """The job's tokenizer (process 0 trains or finds it; the others load it) and this host's
        inputs: the rows `mesh` gives it (`equipax.core.infeed.host_infeed`; the hosts of one context
        group read the same rows)."""
        from equipax.core.infeed import host_infeed
        from equipax.launch.cluster.distributed import barrier, is_primary
        from equipax.launch.store.storage import job_path
        from equipax.launch.tasks.lm_data import DATA_CACHE, build_lm_inputs, build_tokenizer

        tokenizer = build_tokenizer(as_lm(cfg), job_dir, log=log) if is_primary() else None
        barrier("tokenizer")
        tokenizer = tokenizer or build_tokenizer(as_lm(cfg), job_dir)
        infeed = host_infeed(mesh)
        lm = build_lm_inputs(
            as_lm(cfg),
            tokenizer,
            num_infeed_hosts=infeed.num_infeed_hosts,
            infeed_host_index=infeed.infeed_host_index,
            cache_dir=job_path(job_dir) / DATA_CACHE,
        )
        return Inputs(lm.train, lm.eval, info={"unigram_entropy": lm.unigram_entropy}, extra={"tokenizer": tokenizer})

    def finish(
        self, cfg: ExperimentConfig, model: Any, inputs: Inputs, *, key: Any, log: Callable[[str], object]
    ) -> dict[str, Any]:
        """Generate `train.sample.tokens` tokens after `train.sample.prompt` with the KV cache
        (greedy at `train.sample.temperature` 0, else sampled; single process only). Chat data adds
        `chat_data`: this host's conversations trained on, truncated and dropped, and the packing
        efficiency (the share of row positions holding tokens), over the whole run."""
        import jax
        import numpy as np

        from equipax.data import ChatSFTInput

        out: dict[str, Any] = {}
        if isinstance(inputs.train, ChatSFTInput):
            out["chat_data"] = dict(inputs.train.stats, packing_efficiency=round(inputs.train.packing_efficiency(), 4))
        if cfg.train.sample.tokens == 0 or jax.process_count() > 1:
            return out | {"sample": None}
        tokenizer = inputs.extra["tokenizer"]
        prompt = tokenizer.encode(cfg.train.sample.prompt) or [tokenizer.bos_id]
        sampled = continue_ids(
            model, prompt, cfg.train.sample.tokens, temperature=cfg.train.sample.temperature, key=key
        )
        # model.vocab_size may exceed the tokenizer's vocabulary (docs/data.md): ids past it were never
        # a training target, but sampling can still pick one, and no text decodes from it.
        ids = [i for i in np.asarray(sampled).tolist() if i < tokenizer.vocab_size]
        return out | {"sample": tokenizer.decode(ids)}

    def init_state(
        self, cfg: ExperimentConfig, state: "TrainState[Any]", *, model_sharding: Any, log: Callable[[str], object]
    ) -> "TrainState[Any]":
        """`model.init_from=hf:DIR`: `state` with the weights of DIR (behind the parity gate), else `state`."""
        model = as_lm(cfg).model
        if not model.init_from:
            return state
        from equipax.launch.tasks.hf_parity import init_from_hf

        return init_from_hf(model, state, model_sharding, log=log)

    def data_fingerprint(self, cfg: ExperimentConfig, job_dir: AnyPath) -> dict[str, Any]:
        """The model's vocabulary size, the training shards' names and sizes (C4's), and a digest of
        the vocabulary file."""
        lm = as_lm(cfg)
        path = self.vocabulary(cfg, job_dir)
        return {
            "knobs": {"model.vocab_size": lm.model.vocab_size},
            "train_shards": lm.data.token_source.fingerprint(lm.data),
            "vocabulary": None if path is None else _file_digest(path),
        }

    def vocabulary(self, cfg: ExperimentConfig, job_dir: AnyPath) -> AnyPath | None:
        """`data.vocab_path`, or the job's tokenizer.model / tokenizer.json (None: bytes, synthetic ids)."""
        from equipax.launch.tasks.lm_data import tokenizer_path

        return tokenizer_path(as_lm(cfg), job_dir)


FAMILY = LMFamily()
