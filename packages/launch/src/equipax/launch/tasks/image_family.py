"""The image-classification family: ImageClassificationTask on in-memory labelled images."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from equipax.launch.configs.experiment import ExperimentConfig
from equipax.launch.store.storage import AnyPath
from equipax.launch.tasks import Family, Inputs
from equipax.models.configs import cnn_param_count

if TYPE_CHECKING:  # JAX and the models load when a run builds its Task, not for `launch show`
    from jax.sharding import Mesh

    from equipax.models.classifier import ImageClassificationTask

__all__ = ["FAMILY", "ImageFamily"]


class ImageFamily(Family):
    """The image-classification family: `ImageClassificationTask` on labelled images."""

    UNIT: ClassVar[str] = "examples"

    def numbers(self, cfg: ExperimentConfig) -> dict[str, Any]:
        """Parameters (counted from the config: no JAX), images and steps."""
        return {
            "params_total": cnn_param_count(cfg.model),  # pyright: ignore[reportArgumentType]
            "train_images": cfg.data.train_examples,
            "steps_per_epoch": cfg.steps_per_epoch,
            "total_steps": cfg.num_steps,
            "global_batch": cfg.global_batch_size,
            "devices_required": cfg.mesh.num_devices,
            "mesh_shape": list(cfg.mesh.shape),
        }

    def units_per_example(self, cfg: ExperimentConfig) -> int:
        """One image per example (throughput is reported in examples/s)."""
        return 1

    def make_task(self, cfg: ExperimentConfig, mesh: "Mesh | None") -> "ImageClassificationTask":
        """The ImageClassificationTask of `cfg` (the mesh is not needed: GSPMD places activations)."""
        from equipax.models.classifier import ImageClassificationTask

        return ImageClassificationTask(cfg.model, cfg.data.image_shape)  # pyright: ignore[reportArgumentType, reportAttributeAccessIssue]

    def build_inputs(
        self, cfg: ExperimentConfig, job_dir: AnyPath, *, mesh: "Mesh", log: Callable[[str], object]
    ) -> Inputs:
        """This host's share of the training images (shuffled per epoch) and one padded pass of the test
        set: the rows `mesh` gives it (`equipax.core.infeed.host_infeed`)."""
        from equipax.core.infeed import host_infeed
        from equipax.data import ImageClassificationInput

        d: Any = cfg.data
        (train_x, train_y), (test_x, test_y) = d.image_source.load(d)
        infeed = host_infeed(mesh)
        n, i = infeed.num_infeed_hosts, infeed.infeed_host_index
        per_host = cfg.global_batch_size // n
        train = ImageClassificationInput(
            train_x,
            train_y,
            batch_size=per_host,
            seed=d.seed,
            shuffle=d.shuffle,
            num_infeed_hosts=n,
            infeed_host_index=i,
        )
        test = ImageClassificationInput(
            test_x, test_y, batch_size=per_host, repeat=False, shuffle=False, num_infeed_hosts=n, infeed_host_index=i
        )
        return Inputs(train, test, info={"train_images": len(train_x), "test_images": len(test_x)})

    def finish(
        self, cfg: ExperimentConfig, model: Any, inputs: Inputs, *, key: Any, log: Callable[[str], object]
    ) -> dict[str, Any]:
        """Nothing to add after training."""
        return {}

    def data_fingerprint(self, cfg: ExperimentConfig, job_dir: AnyPath) -> dict[str, Any]:
        """The number of images trained on (all of them when `data.num_train` is unset) and the
        source's fingerprint of its files."""
        d: Any = cfg.data
        return {
            "knobs": {"data.num_train": d.image_source.train_size(d)},
            "train_shards": d.image_source.fingerprint(d),
            "vocabulary": None,
        }


FAMILY = ImageFamily()
