"""CIFAR-10 :class:`~lightning.pytorch.LightningDataModule` with three interchangeable data sources.

The data module looks for data in this order and records the one it uses in ``CIFAR10DataModule.source``:

1. ``"torchvision"``: the official binary CIFAR-10 (``<data_dir>/cifar-10-batches-py``), or downloaded there
   by :class:`torchvision.datasets.CIFAR10` when ``download=True``.
2. ``"jpeg-folders"``: the JPEG export with the layout ``train/<class>/*.jpg`` and ``test/<class>/*.jpg``,
   found directly in ``data_dir``, in ``<data_dir>/cifar10-jpg``, or packed as ``cifar10-jpg.tar.gz`` (in
   ``data_dir``, or at the default location ``<repo>/../shared/data/cifar10-jpg.tar.gz``). The archive is
   extracted once into ``<data_dir>/cifar10-jpg`` and the JPEGs are decoded once into uint8 tensor caches
   (``<data_dir>/cifar10-jpg-cache-{train,test}.pt``), so that epochs do not pay for JPEG decoding.
3. ``"synthetic"``: a deterministic, learnable CIFAR-10-shaped stand-in (10 classes of 3x32x32 images made of
   class-specific colour and spatial patterns plus noise), used when no real data is available.

All sources end up as uint8 image tensors of shape ``(N, 3, 32, 32)`` with int64 labels, served by
:class:`TensorImageDataset`, normalised with the CIFAR-10 mean and standard deviation and, for training,
augmented with a random 32x32 crop of the 4-pixel padded image and a random horizontal flip.

The training split is CIFAR-10's 50,000 training images; validation and test both use the 10,000 test images.
``train_samples`` and ``val_samples`` select deterministic subsets (the first ``n`` indices of a permutation
seeded with ``seed``), so every process of a distributed run sees the same data set.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

__all__ = [
    "ARCHIVE_NAME",
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DEFAULT_ARCHIVE",
    "DEFAULT_DATA_DIR",
    "NO_ARCHIVE_ENV",
    "CIFAR10DataModule",
    "TensorImageDataset",
    "make_synthetic_cifar10",
]

REPO_ROOT: Final[Path] = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR: Final[Path] = REPO_ROOT / "data"
ARCHIVE_NAME: Final[str] = "cifar10-jpg.tar.gz"
EXTRACTED_DIR_NAME: Final[str] = "cifar10-jpg"
DEFAULT_ARCHIVE: Final[Path] = REPO_ROOT.parent / "shared" / "data" / ARCHIVE_NAME
NO_ARCHIVE_ENV: Final[str] = "CIFAR10_NO_ARCHIVE"
"""Set this environment variable to ``1`` to disable the lookup of ``cifar10-jpg.tar.gz`` archives."""

CIFAR10_CLASSES: Final[tuple[str, ...]] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
CIFAR10_MEAN: Final[tuple[float, float, float]] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: Final[tuple[float, float, float]] = (0.2470, 0.2435, 0.2616)
SOURCES: Final[tuple[str, ...]] = ("torchvision", "jpeg-folders", "synthetic")

_TORCHVISION_DIR: Final[str] = "cifar-10-batches-py"
_IMAGE_SUFFIXES: Final[frozenset[str]] = frozenset({".jpg", ".jpeg", ".png"})
_FULL_SIZES: Final[dict[str, int]] = {"train": 50_000, "test": 10_000}

Transform = Callable[[Tensor], Tensor]

# Difficulty of the synthetic data set (in units of the prototype's standard deviation): the largest share
# of a random other class blended into a sample, the per-image colour jitter, and the per-pixel noise.
_SYNTHETIC_MAX_MIX: Final[float] = 0.45
_SYNTHETIC_COLOUR_JITTER: Final[float] = 0.5
_SYNTHETIC_NOISE: Final[float] = 1.6


class TensorImageDataset(Dataset[tuple[Tensor, Tensor]]):
    """Images held in memory as one uint8 tensor, transformed on access.

    Args:
        images: uint8 tensor of shape ``(N, 3, H, W)``.
        labels: int64 tensor of shape ``(N,)``.
        transform: Applied to each uint8 image; it must return a float tensor.

    """

    def __init__(self, images: Tensor, labels: Tensor, transform: Transform) -> None:
        if images.ndim != 4 or images.dtype != torch.uint8:
            raise ValueError(f"expected uint8 images (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if labels.shape != images.shape[:1]:
            raise ValueError(f"{len(labels)} labels do not match {len(images)} images")
        self.images = images
        self.labels = labels.long()
        self.transform = transform

    def __len__(self) -> int:
        """Return the number of images."""
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        """Return the transformed image and its label.

        Args:
            index: Position in the data set.

        Returns:
            A ``(image, label)`` pair, the image as a float tensor, the label as a 0-d int64 tensor.

        """
        return self.transform(self.images[index]), self.labels[index]


def make_synthetic_cifar10(num_samples: int, seed: int, split: str = "train") -> tuple[Tensor, Tensor]:
    """Generate a learnable, CIFAR-10-shaped data set deterministically from ``seed``.

    Every class has a fixed prototype (drawn from ``seed`` alone, so it is shared by the splits): a colour
    tint and a smooth spatial pattern that is symmetric under horizontal flips (so flip augmentation keeps the
    class). A sample is its class prototype blended with up to 45 % of a random other class, shifted by up to
    4 pixels, scaled by a random contrast, with a random colour cast and Gaussian pixel noise. The classes
    overlap enough that a small network needs a few epochs to separate them (roughly 35 % -> 65 % -> 75 %
    validation accuracy over three epochs of 5,000 images) instead of solving them in the first epoch. Labels
    are balanced (``i % 10``) and then shuffled.

    Args:
        num_samples: Number of images to generate.
        seed: Seed for the class prototypes and the samples; the same seed always gives the same data.
        split: ``"train"`` or ``"test"``; selects an independent sample stream for each split.

    Returns:
        ``(images, labels)``: a uint8 tensor of shape ``(num_samples, 3, 32, 32)`` and an int64 tensor.

    """
    if split not in _FULL_SIZES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    num_classes = len(CIFAR10_CLASSES)
    proto_gen = torch.Generator().manual_seed(seed)
    tint = torch.rand(num_classes, 3, 1, 1, generator=proto_gen) * 2 - 1
    coarse = torch.randn(num_classes, 3, 4, 4, generator=proto_gen)
    pattern = torch.nn.functional.interpolate(coarse, size=(32, 32), mode="bicubic", align_corners=False)
    pattern = (pattern + pattern.flip(-1)) / 2
    pattern = pattern / pattern.flatten(1).std(dim=1).view(-1, 1, 1, 1)
    prototypes = 0.35 * tint + 0.65 * pattern

    sample_gen = torch.Generator().manual_seed(seed * 2 + (1 if split == "test" else 0) + 1_000_003)
    labels = torch.arange(num_samples) % num_classes
    labels = labels[torch.randperm(num_samples, generator=sample_gen)]
    images = torch.empty(num_samples, 3, 32, 32, dtype=torch.uint8)
    chunk = 4096
    for start in range(0, num_samples, chunk):
        stop = min(start + chunk, num_samples)
        n = stop - start
        # The true class dominates, but a random other class is blended in and the colour is jittered.
        offsets = torch.randint(1, num_classes, (n,), generator=sample_gen)
        others = (labels[start:stop] + offsets) % num_classes
        mix = _SYNTHETIC_MAX_MIX * torch.rand(n, 1, 1, 1, generator=sample_gen)
        base = (1 - mix) * prototypes[labels[start:stop]] + mix * prototypes[others]
        shifts = torch.randint(-4, 5, (n, 2), generator=sample_gen)
        shifted = torch.stack(
            [
                torch.roll(img, shifts=(int(dy), int(dx)), dims=(1, 2))
                for img, (dy, dx) in zip(base, shifts, strict=True)
            ]
        )
        contrast = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=sample_gen)
        jitter = _SYNTHETIC_COLOUR_JITTER * torch.randn(n, 3, 1, 1, generator=sample_gen)
        noise = torch.randn(n, 3, 32, 32, generator=sample_gen)
        values = 128 + 40 * (contrast * shifted + jitter + _SYNTHETIC_NOISE * noise)
        images[start:stop] = values.round().clamp(0, 255).to(torch.uint8)
    return images, labels


def _subset_indices(total: int, num_samples: int | None, seed: int) -> Tensor | None:
    """Return the first ``num_samples`` indices of a seeded permutation, or ``None`` to keep everything."""
    if num_samples is None or num_samples >= total:
        return None
    if num_samples <= 0:
        raise ValueError(f"the number of samples must be positive, got {num_samples}")
    return torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:num_samples]


def _is_jpeg_root(path: Path) -> bool:
    """Whether ``path`` contains ``train/<class>`` and ``test/<class>`` folders for all CIFAR-10 classes."""
    return all((path / split / name).is_dir() for split in _FULL_SIZES for name in CIFAR10_CLASSES)


def _extract_archive(archive: Path, data_dir: Path) -> Path:
    """Extract ``archive`` once into ``<data_dir>/cifar10-jpg`` and return that folder.

    The archive is unpacked into a private temporary folder inside ``data_dir`` and then moved into place
    with :func:`os.replace`, so a crashed or concurrent extraction never leaves a half-filled
    ``cifar10-jpg`` behind. Both archive layouts are accepted: ``train/`` and ``test/`` at the top level, or
    inside one top-level folder.
    """
    target = data_dir / EXTRACTED_DIR_NAME
    if _is_jpeg_root(target):
        return target
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EXTRACTED_DIR_NAME}-extract-", dir=data_dir))
    try:
        rank_zero_info(f"Extracting {archive} into {target} (one time) ...")
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(tmp, filter="data")
        candidates = [tmp, *(child for child in sorted(tmp.iterdir()) if child.is_dir())]
        root = next((path for path in candidates if _is_jpeg_root(path)), None)
        if root is None:
            raise RuntimeError(
                f"{archive} does not contain the expected train/<class>/ and test/<class>/ folders "
                f"for the classes {', '.join(CIFAR10_CLASSES)}"
            )
        _chmod_dir_default(root)
        try:
            os.replace(root, target)
        except OSError:
            # Another process finished first (the target now exists and is not empty): use its copy.
            if not _is_jpeg_root(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _chmod_dir_default(root: Path) -> None:
    """Give a folder made by :func:`tempfile.mkdtemp` (mode 0700) the usual permissions of a new folder."""
    os.chmod(root, 0o777 & ~_umask())


def _decode_split(root: Path, split: str) -> tuple[Tensor, Tensor]:
    """Decode all images of ``root/<split>/<class>/`` into a uint8 tensor ``(N, 3, 32, 32)`` and labels.

    Files are ordered by class (in CIFAR-10 order) and then by name, so the result is deterministic.
    """
    from torchvision.io import ImageReadMode, decode_image, read_file
    from torchvision.transforms.v2 import functional as TF

    images: list[Tensor] = []
    labels: list[int] = []
    for label, name in enumerate(CIFAR10_CLASSES):
        files = sorted(p for p in (root / split / name).iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
        for file in files:
            image = decode_image(read_file(str(file)), mode=ImageReadMode.RGB)
            if image.shape[-2:] != (32, 32):
                image = TF.resize(image, [32, 32], antialias=True)
            images.append(image)
            labels.append(label)
    if not images:
        raise RuntimeError(f"no images found under {root / split}")
    return torch.stack(images), torch.tensor(labels, dtype=torch.long)


def _atomic_torch_save(obj: object, path: Path) -> None:
    """Write ``obj`` with :func:`torch.save` to a temporary file beside ``path``, then rename it there."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp_name)
        os.chmod(tmp_name, 0o666 & ~_umask())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


class CIFAR10DataModule(LightningDataModule):
    """CIFAR-10 from torchvision's binary files, a JPEG-folder export, or a synthetic stand-in.

    See the module docstring for the order in which data sources are tried. The chosen source is available as
    :attr:`source` right after construction (it only depends on which files exist), so all processes of a
    distributed run agree on it.

    Args:
        data_dir: Folder holding (or receiving) the data and the decoded caches. Defaults to ``<repo>/data``.
        batch_size: Batch size per process.
        num_workers: Data loader worker processes per process (0 loads in the main process).
        download: Download the official CIFAR-10 into ``data_dir`` with torchvision if it is not there.
        train_samples: Use only this many training images (a seeded random subset); ``None`` uses all.
        val_samples: Use only this many validation/test images (a seeded random subset); ``None`` uses all.
        seed: Seed for the subsets and for the synthetic data.
        use_archive: Look for a ``cifar10-jpg.tar.gz`` archive (in ``data_dir``, then ``archive_path`` or
            the default shared location). The environment variable ``CIFAR10_NO_ARCHIVE=1`` also disables it.
        archive_path: Archive to use instead of the default ``<repo>/../shared/data/cifar10-jpg.tar.gz``.

    Attributes:
        source: ``"torchvision"``, ``"jpeg-folders"`` or ``"synthetic"``.

    """

    def __init__(
        self,
        data_dir: str | Path = DEFAULT_DATA_DIR,
        batch_size: int = 64,
        num_workers: int = 0,
        download: bool = False,
        train_samples: int | None = None,
        val_samples: int | None = None,
        seed: int = 42,
        use_archive: bool = True,
        archive_path: str | Path | None = None,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.download = download
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.seed = seed
        archive_disabled = os.environ.get(NO_ARCHIVE_ENV, "").strip().lower() in {"1", "true", "yes"}
        self.use_archive = use_archive and not archive_disabled
        self.archive_path = Path(archive_path).expanduser() if archive_path is not None else DEFAULT_ARCHIVE
        self.source: str = self._detect_source()

        self.train_transform: Transform = v2.Compose(
            [
                v2.RandomCrop(32, padding=4),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(CIFAR10_MEAN, CIFAR10_STD),
            ]
        )
        self.eval_transform: Transform = v2.Compose(
            [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        )
        self.train_set: TensorImageDataset | None = None
        self.val_set: TensorImageDataset | None = None
        self._announced = False

    # ------------------------------------------------------------------ source detection
    def _cache_path(self, split: str) -> Path:
        return self.data_dir / f"cifar10-jpg-cache-{split}.pt"

    def _find_jpeg_root(self) -> Path | None:
        for path in (self.data_dir, self.data_dir / EXTRACTED_DIR_NAME):
            if _is_jpeg_root(path):
                return path
        return None

    def _find_archive(self) -> Path | None:
        if not self.use_archive:
            return None
        for path in (self.data_dir / ARCHIVE_NAME, self.archive_path):
            if path.is_file():
                return path
        return None

    def _detect_source(self) -> str:
        if self.download or (self.data_dir / _TORCHVISION_DIR).is_dir():
            return "torchvision"
        caches_ready = all(self._cache_path(split).is_file() for split in _FULL_SIZES)
        if caches_ready or self._find_jpeg_root() is not None or self._find_archive() is not None:
            return "jpeg-folders"
        return "synthetic"

    def describe_source(self) -> str:
        """Return a one-line human-readable description of the data source in use."""
        if self.source == "torchvision":
            return f"torchvision CIFAR-10 binaries in {self.data_dir / _TORCHVISION_DIR}"
        if self.source == "jpeg-folders":
            root = self._find_jpeg_root()
            if root is not None:
                origin = f"JPEG folders in {root}"
            else:
                archive = self._find_archive()
                origin = f"archive {archive}" if archive is not None else "decoded cache"
            return f"CIFAR-10 JPEG export ({origin}; tensor caches in {self.data_dir})"
        return "synthetic CIFAR-10-shaped data (10 classes of 3x32x32 patterns + noise)"

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Download, extract and decode data as needed (Lightning runs this on local rank 0 only)."""
        if self.source == "torchvision" and self.download:
            from torchvision.datasets import CIFAR10

            for train in (True, False):
                CIFAR10(str(self.data_dir), train=train, download=True)
        elif self.source == "jpeg-folders":
            self._prepare_jpeg_caches()

    def _prepare_jpeg_caches(self) -> None:
        missing = [split for split in _FULL_SIZES if not self._cache_path(split).is_file()]
        if not missing:
            return
        root = self._find_jpeg_root()
        if root is None:
            archive = self._find_archive()
            if archive is None:
                raise FileNotFoundError(f"no CIFAR-10 JPEG folders or {ARCHIVE_NAME} for {self.data_dir}")
            root = _extract_archive(archive, self.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for split in missing:
            rank_zero_info(f"Decoding the CIFAR-10 JPEG images in {root / split} into a tensor cache ...")
            images, labels = _decode_split(root, split)
            payload = {"images": images, "labels": labels, "classes": list(CIFAR10_CLASSES)}
            _atomic_torch_save(payload, self._cache_path(split))

    def setup(self, stage: str) -> None:
        """Load the splits needed for ``stage`` (every process builds identical data sets).

        Args:
            stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.

        """
        self._announce_source()
        if stage == "fit" and self.train_set is None:
            images, labels = self._load_split("train", self.train_samples)
            self.train_set = TensorImageDataset(images, labels, self.train_transform)
        if self.val_set is None:
            images, labels = self._load_split("test", self.val_samples)
            self.val_set = TensorImageDataset(images, labels, self.eval_transform)

    def _announce_source(self) -> None:
        if self._announced:
            return
        self._announced = True
        if self.source == "synthetic":
            looked_for = f"{_TORCHVISION_DIR}/, train/ + test/ JPEG folders, {EXTRACTED_DIR_NAME}/"
            looked_for += f", {ARCHIVE_NAME}" if self.use_archive else "; archive lookup disabled"
            rank_zero_warn(
                f"No CIFAR-10 found at {self.data_dir} (looked for {looked_for}); using a SYNTHETIC "
                "CIFAR-10-shaped data set (10 classes of 3x32x32 colour/spatial patterns plus noise, "
                "generated from the seed). Accuracies are NOT comparable to real CIFAR-10: use --download "
                "or provide the data to train on the real thing."
            )
        else:
            rank_zero_info(f"CIFAR-10 data source: {self.source} ({self.describe_source()})")

    def _load_split(self, split: str, num_samples: int | None) -> tuple[Tensor, Tensor]:
        if self.source == "synthetic":
            return make_synthetic_cifar10(num_samples or _FULL_SIZES[split], seed=self.seed, split=split)
        if self.source == "torchvision":
            from torchvision.datasets import CIFAR10

            dataset = CIFAR10(str(self.data_dir), train=split == "train", download=False)
            images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2)
            labels = torch.tensor(dataset.targets, dtype=torch.long)
        else:
            if not self._cache_path(split).is_file():
                # ``setup`` called without ``prepare_data`` (e.g. outside a Trainer); writes are atomic, so
                # this is safe even if several processes get here at once.
                self._prepare_jpeg_caches()
            payload = torch.load(self._cache_path(split), weights_only=True)
            images, labels = payload["images"], payload["labels"]
        indices = _subset_indices(len(labels), num_samples, self.seed)
        if indices is not None:
            images, labels = images[indices], labels[indices]
        return images.contiguous(), labels

    # ------------------------------------------------------------------ data loaders
    def _loader(self, dataset: TensorImageDataset | None, shuffle: bool) -> DataLoader[tuple[Tensor, Tensor]]:
        if dataset is None:
            raise RuntimeError("call setup() before requesting data loaders")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Shuffled, augmented training batches (Lightning adds a ``DistributedSampler`` under DDP)."""
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Validation batches from the CIFAR-10 test split."""
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Test batches: the same CIFAR-10 test split (and subset) as validation."""
        return self._loader(self.val_set, shuffle=False)
