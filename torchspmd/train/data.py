"""Text for the train job: corpora, tokenizers, packing, and a resumable sampler.

The default corpus is the Python standard library's own source, found at run time, so
it exists on every machine. Documents are tokenized once (by rank 0, cached in the
output directory), joined with an end-of-text token and cut into fixed-length
sequences; the last ``eval_fraction`` of them is held out.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from torchspmd.errors import SpmdError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".parquet")


# -- tokenizers -----------------------------------------------------------------------

class ByteTokenizer:
    """Bytes as tokens: ids 0..255, and 256 marks the end of a text."""

    vocab_size = 257
    eos_id = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


#: The end-of-text tokens looked for (in this order) in a tokenizer.json file.
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


class HFTokenizer:
    """A local ``tokenizers`` file (tokenizer.json) or transformers tokenizer directory."""

    def __init__(self, path: str):
        try:
            self._load(path)
        except SpmdError:
            raise
        except Exception as e:  # tokenizers / transformers: a file or directory that holds no tokenizer
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpmdError(f"data.tokenizer = {path!r}: not a tokenizer ({type(e).__name__}: {first}); give "
                            f"'byte', a tokenizer.json file or a transformers tokenizer directory") from None

    def _load(self, path: str) -> None:
        p = Path(path)
        if p.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(p))
            self.vocab_size = self._tok.get_vocab_size()
            self._encode = lambda s: self._tok.encode(s).ids
            self._decode = lambda ids: self._tok.decode(list(ids))
            eos = next((t for t in EOS_TOKENS if self._tok.token_to_id(t) is not None), None)
            if eos is None:
                raise SpmdError(f"data.tokenizer = {path!r} has no end-of-text token ({', '.join(EOS_TOKENS)}), "
                                f"which the job puts between documents and stops generating at; add one to the "
                                f"tokenizer (tokenizer.add_special_tokens) or give a transformers tokenizer "
                                f"directory with an eos_token")
            self.eos_id = self._tok.token_to_id(eos)
        elif p.is_dir():
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(p))
            self.vocab_size = len(self._tok)
            self._encode = lambda s: self._tok.encode(s, add_special_tokens=False)
            self._decode = lambda ids: self._tok.decode(list(ids))
            if self._tok.eos_token_id is None:
                raise SpmdError(f"data.tokenizer = {path!r} has no eos_token, which the job puts between documents "
                                f"and stops generating at; set one (tokenizer.eos_token) and save it again")
            self.eos_id = self._tok.eos_token_id
        else:
            raise SpmdError(f"data.tokenizer = {path!r}: no such file or directory (use 'byte' or a local path)")
        self.name = str(p.resolve())

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids) -> str:
        return self._decode(ids)


def make_tokenizer(spec: str):
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


# -- corpora ----------------------------------------------------------------------------

def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):  # (pruned: rglob also walked site-packages)
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    files = sorted(p for p in files if "site-packages" not in p.parts)
    if not files:
        raise SpmdError(f"the standard library's source was not found under {root}; set data.path")
    return files


def iter_documents(path: str, text_field: str) -> Iterator[str]:
    """Documents from the configured source (see ``DataConfig.path``)."""
    if not path:
        for f in stdlib_files():
            yield f.read_text(encoding="utf-8", errors="replace")
        return
    p = Path(path)
    if not p.exists():
        raise SpmdError(f"data.path = {path!r}: no such file or directory")
    if p.is_dir() and any((p / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(p))
        if isinstance(ds, DatasetDict):  # its 'train' split
            if "train" not in ds:
                raise SpmdError(f"data.path = {path!r}: the data set has no 'train' split (splits: "
                                f"{', '.join(ds.keys())}); save the split to train on as a Dataset, or as 'train'")
            ds = ds["train"]
        if text_field not in ds.column_names:
            raise SpmdError(f"data.path = {path!r}: the data set has no field {text_field!r} "
                            f"(fields: {ds.column_names}); set data.text_field")
        dtype = getattr(ds.features[text_field], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise SpmdError(f"data.path = {path!r}: the data set's field {text_field!r} holds "
                            f"{ds.features[text_field]}, not text; set data.text_field to the field holding the text")
        for rec in ds:
            yield rec[text_field]
        return
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES) if p.is_dir() else [p]
    if not files:
        raise SpmdError(f"data.path = {path!r}: no text files ({', '.join(TEXT_SUFFIXES)}) found")
    for f in files:
        if f.suffix == ".jsonl":
            with f.open(encoding="utf-8", errors="replace") as fh:  # (as .txt files: bad bytes become U+FFFD)
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            rec = json.loads(line)
                        except json.JSONDecodeError as e:
                            why = f"{e.msg.removesuffix(' at')}, column {e.colno}"
                            raise SpmdError(f"{f}:{n}: not a JSON record ({why}); a .jsonl file holds one JSON "
                                            f"object per line") from None
                        if not isinstance(rec, dict):
                            raise SpmdError(f"{f}:{n}: a JSON {type(rec).__name__}, not an object; a .jsonl file "
                                            f"holds one object per line, its text in field {text_field!r}")
                        if text_field not in rec:
                            raise SpmdError(f"{f}:{n}: record has no field {text_field!r}; set data.text_field")
                        text = rec[text_field]
                        if text is not None and not isinstance(text, str):
                            shown = repr(text) if len(repr(text)) <= 60 else repr(text)[:57] + "..."
                            raise SpmdError(f"{f}:{n}: field {text_field!r} holds a JSON {type(text).__name__} "
                                            f"({shown}), not text; set data.text_field to the field holding the text")
                        yield text
        elif f.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise SpmdError(f"{f}: reading .parquet needs pyarrow (pip install pyarrow)") from None
            import pyarrow as pa

            try:
                schema = pq.read_schema(f)
            except (pa.ArrowException, OSError) as e:
                raise SpmdError(f"{f}: not a readable parquet file ({e})") from None
            if text_field not in schema.names:
                raise SpmdError(f"{f}: the table has no field {text_field!r} (fields: {schema.names}); "
                                f"set data.text_field")
            kind = schema.field(text_field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
                raise SpmdError(f"{f}: the table's field {text_field!r} holds {kind}, not text; set data.text_field "
                                f"to the field holding the text")
            table = pq.read_table(f, columns=[text_field])
            yield from (t for t in table.column(text_field).to_pylist() if t)
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def _utf8_prefix(text: str, room: int) -> tuple[str, int]:
    """The longest prefix of ``text`` whose UTF-8 encoding fits in ``room`` bytes (whole
    characters: ``text`` itself when it fits), and its size in bytes."""
    raw = text.encode("utf-8", "surrogatepass")  # (a JSON string may hold a lone surrogate)
    if len(raw) <= room:
        return text, len(raw)
    for cut in range(room, max(-1, room - 4), -1):  # a character is at most 4 bytes
        try:
            return raw[:cut].decode("utf-8", "surrogatepass"), cut
        except UnicodeDecodeError:
            continue
    return "", 0


def tokenize_corpus(path: str, text_field: str, tokenizer, max_bytes: int) -> np.ndarray:
    """The corpus's documents, tokenized, each followed by the end-of-text token. With
    ``max_bytes``, at most that many bytes of text (UTF-8) are taken: the document that
    reaches the limit is cut there, at a character boundary."""
    ids: list[int] = []
    seen = 0
    for doc in iter_documents(path, text_field):
        if not doc:
            continue
        whole = True
        if max_bytes:
            cut, size = _utf8_prefix(doc, max_bytes - seen)
            seen, whole, doc = seen + size, cut is doc, cut
            if not doc:
                break
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eos_id)
        if not whole or (max_bytes and seen >= max_bytes):
            break
    if not ids:
        within = f" within its first data.max_bytes = {max_bytes} bytes" if max_bytes else ""
        raise SpmdError(f"data.path = {path!r}: holds no text{within}")
    dtype = np.uint16 if tokenizer.vocab_size < 2**16 else np.int32
    return np.asarray(ids, dtype=dtype)


def _fingerprint(path: str) -> list:
    """Name, size and modification time of every file under ``path`` (a file or a
    directory; empty: the standard library's corpus). Part of the token cache's key, so a
    corpus or tokenizer edited, replaced or grown in place gets a new cache entry instead
    of the old tokens."""
    files = stdlib_files() if not path else (
        sorted(f for f in Path(path).rglob("*") if f.is_file()) if Path(path).is_dir() else [Path(path)])
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


def load_tokens(cfg, tokenizer, cache_dir: Path) -> np.ndarray:
    """Tokenize once (rank 0) into ``cache_dir``; every process then maps the file."""
    key = hashlib.sha1(json.dumps(["max_bytes in UTF-8 bytes, the last document cut",  # (was: characters)
                                   cfg.path and str(Path(cfg.path).resolve()), cfg.text_field, tokenizer.name,
                                   cfg.max_bytes, _fingerprint(cfg.path),
                                   [] if tokenizer.name == "byte" else _fingerprint(tokenizer.name)]
                                  ).encode()).hexdigest()[:12]
    cache = cache_dir / f"tokens-{key}.npy"
    rank = dist.get_rank() if dist.is_initialized() else 0
    error: list[str] = []
    if rank == 0 and not cache.exists():
        try:
            tokens = tokenize_corpus(cfg.path, cfg.text_field, tokenizer, cfg.max_bytes)
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}.npy")
            np.save(tmp, tokens)
            os.replace(tmp, cache)
        except SpmdError as e:
            error.append(str(e))
    if dist.is_initialized():
        box = [error[0] if error else None]
        dist.broadcast_object_list(box, src=0)
        error = [box[0]] if box[0] else []
    if error:
        raise SpmdError(error[0])
    return np.load(cache, mmap_mode="r")


class PackedSequences(torch.utils.data.Dataset):
    """Fixed-length windows of a token stream: ``(x, y)`` with ``y`` shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int, count: int):
        self.tokens, self.seq_len, self.start, self.count = tokens, seq_len, start, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        if not 0 <= i < self.count:
            raise IndexError(i)
        off = (self.start + i) * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[off : off + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]


def _counts(n_tokens: int, seq_len: int, eval_fraction: float) -> tuple[int, int]:
    """Sequences for training and held out, from ``n_tokens`` tokens."""
    n = max(0, (n_tokens - 1) // seq_len)
    n_eval = max(1, int(n * eval_fraction)) if eval_fraction > 0 and n else 0
    return n - n_eval, n_eval


def split(tokens: np.ndarray, seq_len: int, eval_fraction: float) -> tuple[PackedSequences, PackedSequences]:
    n_train, n_eval = _counts(len(tokens), seq_len, eval_fraction)
    if n_train + n_eval < 2:
        raise SpmdError(f"the corpus has {len(tokens)} tokens: not enough for two sequences of data.seq_len = "
                        f"{seq_len}; give more text or a shorter data.seq_len")
    return PackedSequences(tokens, seq_len, 0, n_train), PackedSequences(tokens, seq_len, n_train, n_eval)


def check_corpus(n_tokens: int, data_cfg, optim_cfg) -> None:
    """The corpus must fill one (micro-)batch of training sequences, else an error naming
    the settings to change."""
    micro = optim_cfg.batch_size // optim_cfg.grad_accum
    n_train, n_eval = _counts(n_tokens, data_cfg.seq_len, data_cfg.eval_fraction)
    if n_train >= micro and n_train + n_eval >= 2:
        return
    batch = ("a micro-batch (optim.batch_size / optim.grad_accum)" if optim_cfg.grad_accum > 1
             else "a batch (optim.batch_size)")
    held = f" and {n_eval} held out (data.eval_fraction = {data_cfg.eval_fraction})" if n_eval else ""
    cap = f"; data.max_bytes = {data_cfg.max_bytes} limits what is read, 0: no limit" if data_cfg.max_bytes else ""
    raise SpmdError(f"the corpus is smaller than one batch: its {n_tokens} tokens make {n_train} training "
                    f"sequences of data.seq_len = {data_cfg.seq_len}{held}, and {batch} takes {micro}; give more "
                    f"text (data.path{cap}), or lower optim.batch_size or data.seq_len")


class ResumableBatchSampler(torch.utils.data.Sampler):
    """Global batches of indices, shuffled per epoch from ``seed``; starts at batch
    ``start`` (the number already consumed), so a resumed run sees exactly the batches
    an uninterrupted one would. Deterministic: every process draws the same batches."""

    def __init__(self, size: int, batch_size: int, seed: int, start: int = 0):
        if size < batch_size:
            raise SpmdError(f"a batch of {batch_size} sequences (optim.batch_size / optim.grad_accum) is more than "
                            f"the {size} training sequences of the corpus; give more text (data.path, "
                            f"data.max_bytes), or lower optim.batch_size or data.seq_len")
        self.size, self.batch_size, self.seed, self.start = size, batch_size, seed, start
        self.per_epoch = size // batch_size  # drop the odd last batch

    def __len__(self) -> int:
        return 1 << 62

    def __iter__(self):
        index = self.start
        cached_epoch, perm = None, None
        while True:
            epoch, pos = divmod(index, self.per_epoch)
            if epoch != cached_epoch:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perm, cached_epoch = torch.randperm(self.size, generator=g), epoch
            yield perm[pos * self.batch_size : (pos + 1) * self.batch_size].tolist()
            index += 1
