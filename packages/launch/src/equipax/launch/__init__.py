"""equipax.launch: the `launch` command line, the experiment registry and the training program.

Importing this package imports nothing else (the CLI installs its signal handlers before its
heavy imports); use the submodules. One folder per concern, in layers that import only their own
layer or lower (docs/extending.md, "Layers of equipax.launch"; tests/repo/test_layers.py):

- 0: `exit_codes.py` and `failures.py` (the run-ending failures, each with its exit code);
  `store/`: where files live (local, `gs://`, `s3://`), the machine's cache; `hardware/`: the
  accelerators, TPU slices, compiler flags;
- 1: `configs/`: the config schemas (`ExperimentConfig`, `TrainConfig`, the data configs);
  `cluster/`: multi-process start-up;
- 2: `tasks/`: the task families with the inputs they build; `experiments/`: the registry and
  the built-in experiments; `jobdir/`: the job directory (ownership, checkpoints and checksums,
  metrics and summaries, plots);
- 3: `program/`: an experiment's model on a mesh (`build_program`) and its training program
  (`build_training`);
- 4: `aot/`: ahead-of-time compile reports (`launch compile`); `inference/`: offline use of a
  trained job (`launch decode`, `launch eval`); `bench/`: `launch bench`;
- 5: `training/`: the one training loop, where a run starts (`resume_or_start`), its hooks, the
  resume checks;
- 6: `translators/`: other frameworks' configs and checkpoints (MaxText, Hugging Face);
- 7: `errors.py` (what a failure prints) and `commands/` (the CLI commands); 8: `cli.py`.
"""

__all__: list[str] = []
