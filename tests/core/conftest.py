"""A small generated two-source dataset (JSONL and multi-frame JSONL.zst) and a BPE tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from zephon_stream.loader.config import Config, SourceConfig

WORDS = ("the of and to in is that for it as with was on be by this are or from at an which not have "
         "loader lane shard token sample batch epoch seed order state window pack mix read split").split()


def make_docs(rng: random.Random, n: int, max_words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words))) + rng.choice([".", "!", "?\n"])
            for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], zst: bool = False, frame_docs: int = 7) -> None:
    lines = [msgspec.json.encode({"id": i, "text": t}) + b"\n" for i, t in enumerate(docs)]
    if not zst:
        path.write_bytes(b"".join(lines))
        return
    c = zstandard.ZstdCompressor(level=3)
    path.write_bytes(b"".join(c.compress(b"".join(lines[i:i + frame_docs]))
                              for i in range(0, len(lines), frame_docs)))


def build_dataset(root: Path) -> dict[str, list[str]]:
    rng = random.Random(7)
    docs = {"a": make_docs(rng, 600, 60), "b": make_docs(rng, 300, 200)}
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    for i in range(3):
        write_jsonl(root / "a" / f"a-{i}.jsonl", docs["a"][i * 200:(i + 1) * 200])
    for i in range(2):
        write_jsonl(root / "b" / f"b-{i}.jsonl.zst", docs["b"][i * 150:(i + 1) * 150], zst=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs["a"][:100], trainer=trainer)
    tok.save(str(root / "tokenizer.json"))
    return docs


def batches_to(loader, steps: int) -> list:
    """The batches of a `for` loop over `loader` until it has consumed `steps` global batches."""
    out = []
    for batch in loader:
        out.append(batch)
        if loader.step == steps:
            break
    return out


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("data")
    return root, build_dataset(root)


@pytest.fixture()
def config(dataset: tuple[Path, dict[str, list[str]]]) -> Config:
    root, _ = dataset
    return Config(seed=1234, lanes=12, seq_len=64, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                  shuffle_window=8, split_bytes=4096, sample_batch=2,
                  sources=[SourceConfig(name="a", uri=f"file://{root}/a/", weight=0.6),
                           SourceConfig(name="b", uri=f"file://{root}/b/", weight=0.4)])


VISION_TOKENS = ["<|endoftext|>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"]


def make_image(rng: random.Random, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A small generated image: a gradient with noise, of a random size and aspect."""
    import io

    import numpy as np
    from PIL import Image

    h, w = rng.randint(8, 96), rng.randint(8, 96)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], axis=-1)
    noise = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 40, (h, w, 3))
    im = Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB").convert(mode)
    out = io.BytesIO()
    im.save(out, fmt)
    return out.getvalue()


def build_vision_dataset(root: Path, n: int = 480, shards: int = 3) -> dict[str, list[str]]:
    """Image+caption tar shards under root/img (generated images, captions from WORDS) and a
    tokenizer with the vision special tokens at root/vision-tokenizer.json."""
    from zephon_stream.formats.tar import write_tar_shards

    rng = random.Random(11)
    captions = make_docs(rng, n, 30)
    samples = [(f"{i:06d}", {"png": make_image(rng), "txt": captions[i].encode()}) for i in range(n)]
    (root / "img").mkdir(parents=True)
    per = -(-n // shards)
    for s in range(shards):
        write_tar_shards(samples[s * per:(s + 1) * per], root / "img", prefix=f"img{s}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=VISION_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(captions, trainer=trainer)
    tok.save(str(root / "vision-tokenizer.json"))
    return {"img": captions}


@pytest.fixture(scope="session")
def vision_dataset(tmp_path_factory: pytest.TempPathFactory, dataset) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("vision")
    return root, build_vision_dataset(root)


@pytest.fixture()
def vision_config(vision_dataset, dataset) -> Config:
    """An image+text source mixed with a text-only one, LLaVA style (L = 12)."""
    from zephon_stream.loader.config import VisionConfig

    root, _ = vision_dataset
    text_root, _ = dataset
    return Config(seed=1234, lanes=12, seq_len=64, global_batch_size=24, tokenizer=str(root / "vision-tokenizer.json"),
                  shuffle_window=8, split_bytes=8192, sample_batch=2,
                  vision=VisionConfig(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                                      min_pixels=784, max_pixels=28 * 28 * 16, decode_batch=3),
                  sources=[SourceConfig(name="img", uri=f"file://{root}/img/", weight=0.7, image_field="jpg;png",
                                        text_field="txt"),
                           SourceConfig(name="a", uri=f"file://{text_root}/a/", weight=0.3)])


def build_parquet_dataset(root: Path, docs: dict[str, list[str]]) -> None:
    """The text dataset as Parquet written by pyarrow: source a with a `text` column (uncompressed,
    row groups of 23 rows), source b with the text nested in a struct column (`doc.body`, row groups of 11): each
    source has more splits than `config` has lanes, as the determinism matrix needs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    for i in range(3):
        rows = docs["a"][i * 200:(i + 1) * 200]
        pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}), root / "a" / f"a-{i}.parquet",
                       row_group_size=23, compression="none")
    for i in range(2):
        rows = docs["b"][i * 150:(i + 1) * 150]
        nested = [{"lang": "en", "body": t} for t in rows]
        pq.write_table(pa.table({"doc": nested}), root / "b" / f"b-{i}.parquet", row_group_size=11)


def build_gzip_dataset(root: Path, docs: dict[str, list[str]]) -> None:
    """The text dataset as gzip: source a in files of several members (a member every 17 lines,
    as bgzip or `pigz --independent` write), source b as 12 single-member `.json.gz` files (one
    split each: as many splits as `config` has lanes)."""
    import gzip

    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    def lines(part: list[str]) -> list[bytes]:
        return [msgspec.json.encode({"id": n, "text": t}) + b"\n" for n, t in enumerate(part)]

    for i in range(3):
        a = lines(docs["a"][i * 200:(i + 1) * 200])
        (root / "a" / f"a-{i}.jsonl.gz").write_bytes(b"".join(gzip.compress(b"".join(a[k:k + 17]), mtime=0)
                                                              for k in range(0, len(a), 17)))
    for i in range(12):
        b = lines(docs["b"][i * 25:(i + 1) * 25])
        (root / "b" / f"b-{i:02d}.json.gz").write_bytes(gzip.compress(b"".join(b), mtime=0))


def build_refilled_dataset(root: Path, docs: dict[str, list[str]]) -> None:
    """Source a of the text dataset with its last file as one gzip member, which cannot be cut into
    its share of splits: the two JSONL files beside it take the rest of that share (a refilled plan)."""
    import gzip

    (root / "a").mkdir(parents=True)
    for i in range(3):
        data = b"".join(msgspec.json.encode({"id": n, "text": t}) + b"\n"
                        for n, t in enumerate(docs["a"][i * 200:(i + 1) * 200]))
        name, data = (f"a-{i}.jsonl.gz", gzip.compress(data, mtime=0)) if i == 2 else (f"a-{i}.jsonl", data)
        (root / "a" / name).write_bytes(data)


@pytest.fixture(scope="session")
def refilled_dataset(tmp_path_factory: pytest.TempPathFactory, dataset) -> Path:
    root = tmp_path_factory.mktemp("refilled")
    build_refilled_dataset(root, dataset[1])
    return root


@pytest.fixture(scope="session")
def parquet_dataset(tmp_path_factory: pytest.TempPathFactory, dataset) -> Path:
    root = tmp_path_factory.mktemp("parquet")
    build_parquet_dataset(root, dataset[1])
    return root


@pytest.fixture(scope="session")
def gzip_dataset(tmp_path_factory: pytest.TempPathFactory, dataset) -> Path:
    root = tmp_path_factory.mktemp("gzip")
    build_gzip_dataset(root, dataset[1])
    return root


def _text_config(dataset, sources: list[SourceConfig]) -> Config:
    """The settings of `config` (which tests may override under its name) on other sources."""
    root, _ = dataset
    return Config(seed=1234, lanes=12, seq_len=64, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                  shuffle_window=8, split_bytes=4096, sample_batch=2, sources=sources)


@pytest.fixture()
def parquet_config(dataset, parquet_dataset) -> Config:
    """`config` on the Parquet copy of its data (source b reads the nested column `doc.body`)."""
    return _text_config(dataset, [
        SourceConfig(name="a", uri=f"file://{parquet_dataset}/a/", weight=0.6),
        SourceConfig(name="b", uri=f"file://{parquet_dataset}/b/", weight=0.4, text_field="doc.body")])


@pytest.fixture()
def gzip_config(dataset, gzip_dataset) -> Config:
    """`config` on the gzip copy of its data (a: multi-member files, b: single-member)."""
    return _text_config(dataset, [SourceConfig(name="a", uri=f"file://{gzip_dataset}/a/", weight=0.6),
                                  SourceConfig(name="b", uri=f"file://{gzip_dataset}/b/", weight=0.4)])


@pytest.fixture()
def refilled_config(dataset, refilled_dataset) -> Config:
    """`config` with source a's last file as one gzip member (`build_refilled_dataset`)."""
    root, _ = dataset
    return _text_config(dataset, [SourceConfig(name="a", uri=f"file://{refilled_dataset}/a/", weight=0.6),
                                  SourceConfig(name="b", uri=f"file://{root}/b/", weight=0.4)])


def build_vision_parquet(root: Path, n: int = 240, files: int = 3) -> list[bytes]:
    """Generated PNGs with captions as Parquet written by pyarrow, in HF's `Image` layout: an `image`
    column of struct<bytes: binary, path: string> beside a `caption` column (row groups of 10)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(13)
    captions = make_docs(rng, n, 30)
    images = [make_image(rng) for _ in range(n)]
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    (root / "pq").mkdir(parents=True)
    per = -(-n // files)
    for f in range(files):
        rows = range(f * per, min(n, (f + 1) * per))
        table = pa.table({"image": pa.array([{"bytes": images[i], "path": f"{i:06d}.png"} for i in rows], image_type),
                          "caption": [captions[i] for i in rows]})
        pq.write_table(table, root / "pq" / f"img-{f}.parquet", row_group_size=10)
    return images


@pytest.fixture(scope="session")
def vision_parquet_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[bytes]]:
    root = tmp_path_factory.mktemp("vision-parquet")
    return root, build_vision_parquet(root)


@pytest.fixture()
def vision_parquet_config(vision_config, vision_parquet_dataset) -> Config:
    """`vision_config` with its image source read from Parquet (HF Image column `image`, captions in `caption`)."""
    root, _ = vision_parquet_dataset
    img = SourceConfig(name="img", uri=f"file://{root}/pq/", weight=0.7, image_field="image", text_field="caption")
    return vision_config.replace(sources=[img, vision_config.sources[1]])


@pytest.fixture(scope="session")
def ray_child(tmp_path_factory: pytest.TempPathFactory):
    """The one Ray child of the session (tests/core/test_ray.py: `RayChild`), or a skip with the reason."""
    from tests.core.test_ray import RayChild, sandbox_problem

    problem = sandbox_problem()
    if problem:
        pytest.skip(problem)
    return RayChild(tmp_path_factory.mktemp("ray"))


#: Determinism-matrix cases (tests/core/test_determinism.py) run for the text config alone: the
#: second and third runs through worker processes (under injected latency, and resumed onto them).
#: Every other config still streams through worker processes once (`test_world_sizes_and_backends`
#: at dp 2) and resumes across worlds and backends twice; these two cases cost a third of a
#: config's matrix (worker processes start by importing the package) and test nothing that
#: depends on the source format, the packing or the transforms.
TEXT_ONLY_CASES = {("test_injected_read_latency", ("processes",)),
                   ("test_resume_onto_other_world_and_backend", (1, (4, "threads"), (2, "processes")))}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        fn = getattr(item, "function", None)
        if spec is None or fn is None or fn.__module__ != "tests.core.test_determinism" or spec.params.get(
                "config", "text") == "text":
            keep.append(item)
            continue
        args = tuple(v for k, v in spec.params.items() if k != "config")
        (drop if (fn.__name__, args) in TEXT_ONLY_CASES else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
