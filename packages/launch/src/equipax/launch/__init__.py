"""equipax.launch: the `launch` command line, the experiment registry and the training program.

Importing this package imports nothing else (the CLI installs its signal handlers before its
heavy imports); use the submodules: `equipax.launch.experiments.registry`,
`equipax.launch.training.build`, `equipax.launch.cli`.
"""

__all__: list[str] = []
