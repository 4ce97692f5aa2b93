"""equipax.launch: the `launch` command line, the experiment registry and the training program.

Importing this package imports nothing else (the CLI installs its signal handlers before its
heavy imports); use the submodules. One folder per concern:

- `configs/`: the config schemas (`ExperimentConfig`, `TrainConfig`, the data configs);
- `experiments/`: the registry and the built-in experiment definitions;
- `tasks/`: the task families (language model, image classifier) with the inputs they build;
- `program/`: an experiment's model on a mesh (`build_program`) and its training program
  (`build_training`);
- `training/`: the one training loop, where a run starts (`resume_or_start`) and its hooks;
- `jobdir/`: the job directory (ownership and lock, checkpoints and checksums, resume checks,
  metrics and summaries, plots);
- `inference/`: offline use of a trained job (`launch decode`, `launch eval`);
- `translators/`: other frameworks' configs as equipax knobs (MaxText);
- `aot/`: ahead-of-time compile reports (`launch compile`); `bench/`: `launch bench`;
- `cluster/`: multi-process start-up; `commands/`: the CLI commands (`cli.py` wires them);
  `errors.py` and `exit_codes.py`: what a failure prints and returns.
"""

__all__: list[str] = []
