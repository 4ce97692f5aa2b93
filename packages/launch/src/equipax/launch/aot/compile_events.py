"""Time JAX spends tracing, lowering and compiling, from its `jax.monitoring` events.

One listener serves both uses: sampling keeps compilation out of its seconds per token
(`equipax.launch.inference.sampling`), and the loop reports what XLA compiled while a step was
dispatched (`StepContext.compile_seconds`: a recompile, such as PGLE's).
"""

import jax

__all__ = ["BACKEND_COMPILE", "CompileEvents", "COMPILE_EVENTS"]

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# What JAX reports while tracing and compiling (jax._src.dispatch).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    BACKEND_COMPILE,
)


class CompileEvents:
    """Inside `with CompileEvents() as c:`, `c.seconds` sums the tracing, lowering and XLA compile
    time JAX reports, and `c.backend_seconds` XLA's compile time alone."""

    def __enter__(self) -> "CompileEvents":
        self.seconds: float = 0.0
        self.backend_seconds: float = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def _on_event(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration_secs
        if event == BACKEND_COMPILE:
            self.backend_seconds += duration_secs

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)
