"""An experiment's model on a mesh (`build_program` -> `Program`: what decode, eval, the Hugging
Face conversions and a checkpoint's restore need) and the program that trains it
(`build_training` -> `Training`: the learner, the train state and the train step besides)."""

__all__: list[str] = []
