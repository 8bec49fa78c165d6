"""The tokenizer: a typed wrapper over a local HF tokenizer (HF folder or GGUF). No torch here."""

from __future__ import annotations

import copy
import functools
import os
import threading
from typing import Any

from lightwell.model_files import ModelFiles


class Tokenizer:
    """Encodes text, decodes ids and renders chat templates for one model.

    Wraps a ``transformers`` tokenizer (``hf``). Decoding never cleans up tokenization spaces, so
    a one-shot ``decode`` equals what the incremental detokenizer streams.
    """

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self._vocab_size = len(hf)
        self._all_special_ids = sorted(set(hf.all_special_ids))
        self._pieces: dict[int, str] = {}

    @classmethod
    def load(cls, files: ModelFiles, tokenizer_path: str | None = None) -> Tokenizer:
        """Load the tokenizer of ``files``, or from ``tokenizer_path`` (a folder or a .gguf file).

        Only local files are read; nothing is downloaded.
        """
        if tokenizer_path is not None:
            path = os.path.abspath(os.path.expanduser(tokenizer_path))
            if not os.path.exists(path):
                raise FileNotFoundError(f"tokenizer path {tokenizer_path!r} does not exist")
            kind = "gguf" if os.path.isfile(path) and path.endswith(".gguf") else "hf"
            if kind == "hf" and not os.path.isdir(path):
                raise ValueError(f"tokenizer path {tokenizer_path!r} is neither a folder nor .gguf")
            files = ModelFiles(kind, path, os.path.basename(path))
        return cls(_load_hf_tokenizer(files))

    @property
    def hf(self) -> Any:
        """The underlying ``transformers`` tokenizer."""
        return self._hf

    @property
    def backend(self) -> Any | None:
        """The ``tokenizers.Tokenizer`` behind a fast tokenizer, or None for a slow one."""
        return getattr(self._hf, "backend_tokenizer", None)

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(tokenizer)``)."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._all_special_ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self._hf, "chat_template", None)

    def __len__(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def id_to_piece(self, token_id: int) -> str:
        """The decoded text of one token (special tokens included), e.g. for logprobs."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self.decode([token_id], skip_special_tokens=False)
            self._pieces[token_id] = piece
        return piece

    def render_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a chat: ``messages`` rendered by the (or the given) chat template."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                "this model's tokenizer has no chat template: pass chat_template=... "
                "(or a --chat-template file), or send a plain completion prompt"
            )
        return self._hf.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """The prompt token ids of a chat. The template writes any BOS itself, so none is added."""
        text = self.render_chat_template(messages, add_generation_prompt, chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _load_hf_tokenizer(files: ModelFiles) -> Any:
    from transformers import AutoTokenizer  # heavy: imported only when a tokenizer is loaded

    try:
        if files.kind == "gguf":
            st = os.stat(files.path)
            built = _gguf_tokenizer(os.path.abspath(files.path), st.st_mtime_ns, st.st_size)
            # the first engine takes the built tokenizer (one copy in memory), later ones a
            # copy each: a fast tokenizer is not safe to share across threads
            with _HANDOUT:
                if not built["handed_out"]:
                    built["handed_out"] = True
                    return built["tokenizer"]
                return copy.deepcopy(built["tokenizer"])
        if files.kind == "hf":
            return AutoTokenizer.from_pretrained(files.path, local_files_only=True)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # (transformers' messages run over several lines)
        if files.kind == "hf" and not any(
            os.path.exists(os.path.join(files.path, f)) for f in _TOKENIZER_FILES
        ):
            reason = f"it holds none of {', '.join(_TOKENIZER_FILES)} ({reason})"
        raise ValueError(f"could not load a tokenizer from {files.path!r}: {reason}") from e
    raise ValueError(f"unknown model files kind {files.kind!r} (expected 'hf' or 'gguf')")


# files a folder's tokenizer is read from (one of them at least)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
_HANDOUT = threading.Lock()  # a built GGUF tokenizer goes to one engine; the others copy it


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """The tokenizer of a GGUF file, once per process (transformers converts the vocabulary in
    the file's metadata: seconds, so the result is also kept on disk, engine/tokenizer_cache.py;
    a copy takes a fraction of that), and whether an engine holds it already."""
    from transformers import AutoTokenizer

    from lightwell.engine.tokenizer_cache import cached_tokenizer

    folder, name = os.path.split(path)

    def build() -> Any:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)

    return {"tokenizer": cached_tokenizer(path, mtime_ns, size, build), "handed_out": False}
