"""The pipeline section of `launch compile`'s report: stages, schedule, microbatches, bubble.

The figures are `launch show`'s (`equipax.launch.tasks.lm_family.LMFamily.numbers`, analytic from the config);
this module picks them out of the family's numbers, so the two commands cannot disagree.
"""

from typing import Any

__all__ = ["PER_DEVICE_NOTE", "pipeline_lines", "pipeline_section"]

# report key: `launch show`'s key
_KEYS = {
    "stages": "pipeline_stages",
    "repeats": "pipeline_repeats",
    "schedule": "pipeline_schedule",
    "microbatches": "pipeline_microbatches",
    "microbatch_size": "pipeline_microbatch_size",
    "bubble_fraction": "pipeline_bubble_fraction",
    "params_per_stage": "params_per_stage",
    "stage_state_bytes_per_device": "stage_state_bytes_per_device",
}

PER_DEVICE_NOTE = (
    "params.per_device_param_bytes and params.per_device_optimizer_bytes are one stage's share: "
    "the stage's layers and the embedding (every stage holds it), split over fsdp x tensor"
)


def pipeline_section(numbers: dict[str, Any]) -> dict[str, Any] | None:
    """The report's `pipeline` entry from a family's `numbers(cfg)`; None without a pipeline."""
    if numbers.get("pipeline_stages", 1) <= 1:
        return None
    return {key: numbers[name] for key, name in _KEYS.items()} | {"per_device_bytes": PER_DEVICE_NOTE}


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def pipeline_lines(p: dict[str, Any]) -> list[str]:
    """The report's text lines for a `pipeline_section`."""
    repeats = f"{p['repeats']} repeat" + ("s" if p["repeats"] > 1 else "")
    return [
        f"  pipeline      {p['stages']} stages x {repeats} ({p['schedule']}), {p['microbatches']} microbatches "
        f"of {p['microbatch_size']} examples, bubble {p['bubble_fraction']:.1%} = (S - 1) / (R x M + S - 1)",
        f"                {p['params_per_stage']:,} params per stage; one stage's state per device "
        f"{_bytes(p['stage_state_bytes_per_device'])} analytic (its layers + the embedding, f32 params + Adam)",
    ]
