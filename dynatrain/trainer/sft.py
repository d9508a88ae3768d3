"""Supervised fine-tuning data: chat conversations, the loss on the assistant's tokens only.

Input: a ``.jsonl`` file, one conversation per line, ``{"messages": [{"role": ..., "content":
...}, ...]}`` (other fields ignored). Each conversation is rendered with the tokenizer's chat
template (``chat_template`` of ``tokenizer_config.json``, or a ``chat_template.jinja`` file
beside it) the way ``transformers``' ``apply_chat_template`` renders it (a sandboxed Jinja
environment with ``trim_blocks``/``lstrip_blocks``, the special tokens as variables), then
tokenised without adding special tokens, as ``apply_chat_template(tokenize=True)`` does.

Which tokens are the assistant's: for assistant message ``i``, its characters are those between
the rendering of messages ``[:i]`` with the generation prompt and the rendering of messages
``[:i+1]``: its content and whatever the template closes a turn with (an end-of-turn token,
which the model must learn to emit). A token is trained when its first character lies in such
a span. This needs a template whose rendering of a conversation's first messages is a prefix
of the whole rendering; one that is not (e.g. one that drops earlier turns' reasoning) is
refused with a message, not guessed at.

Packing: conversations are laid, in file order, into windows of ``seq_len + 1`` tokens; a
window takes whole conversations while the next one fits, then is padded (the tokenizer's pad
token, else its EOS, else id 0; padding is never trained). A conversation longer than a window
is truncated to one window. The first token of every conversation is never a trained target,
so no loss term predicts one conversation from another. **Attention is causal over the whole
window: a conversation's tokens attend to the conversations before it in the same window**
(there is no block-diagonal mask); the loss never crosses conversations. Where that
cross-attention matters, choose a ``seq_len`` near the conversations' length, so that windows
rarely hold more than one.

Rendering happens in each process that reads the file (once per process and file: a live
switch's new trainer finds it cached), which suits SFT sets up to some hundred thousand
conversations.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .textdata import DataError, _stamp, load_tokenizer


def chat_template(directory: str | Path) -> str:
    """The tokenizer directory's chat template (its ``default`` one where there are several)."""
    d = Path(directory)
    config = d / "tokenizer_config.json"
    value = None
    if config.is_file():
        value = json.loads(config.read_text()).get("chat_template")
    if isinstance(value, list):                  # [{name, template}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is None and (d / "chat_template.jinja").is_file():
        value = (d / "chat_template.jinja").read_text()
    if not isinstance(value, str) or not value:
        raise DataError(f"tokenizer {str(directory)!r} has no chat template (chat_template in "
                        "tokenizer_config.json or chat_template.jinja): SFT data needs one")
    return value


def special_tokens(directory: str | Path) -> dict[str, str]:
    """``bos_token``, ``eos_token`` ... of ``tokenizer_config.json``, as templates see them."""
    config = Path(directory) / "tokenizer_config.json"
    out = {}
    if config.is_file():
        for k, v in json.loads(config.read_text()).items():
            if isinstance(v, dict):
                v = v.get("content")
            if k.endswith("_token") and isinstance(v, str):
                out[k] = v
    return out


def _generation_extension():
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' marker of assistant text in
        some templates) renders its body; which tokens are trained is found by rendering."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation


class Renderer:
    def __init__(self, directory: str | Path):
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        _Generation = _generation_extension()

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _Generation])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                  indent=indent)
        self.directory = directory
        try:
            self.template = env.from_string(chat_template(directory))
        except TemplateError as e:
            raise DataError(f"the chat template of {str(directory)!r} does not parse: "
                            f"{e}") from None
        self.special = special_tokens(directory)

    def __call__(self, messages: list, add_generation_prompt: bool = False) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except TemplateError as e:
            raise DataError(f"the chat template of {str(self.directory)!r} fails: {e}") from None


def render_conversation(render: Renderer, tok, messages: list) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, trained) of one conversation: ``trained[k]`` says token ``k`` is one of the
    assistant's (see the module's rule)."""
    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], add_generation_prompt=True)
        through = render(messages[:i + 1])
        if not (text.startswith(before) and text.startswith(through)
                and len(before) <= len(through)):
            raise DataError(f"the chat template of {str(render.directory)!r} does not render "
                            "a conversation's first messages as a prefix of the whole, so the "
                            "assistant's tokens cannot be found by rendering")
        spans.append((len(before), len(through)))
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    starts = np.asarray([a for a, _ in enc.offsets], dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        trained |= (starts >= a) & (starts < b)
    return ids, trained


def read_messages(path: Path):
    """(line number, messages) of each non-blank line, checked."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{number}: not JSON ({e})") from None
            messages = value.get("messages") if isinstance(value, dict) else None
            if not isinstance(messages, list) or not messages:
                raise DataError(f"{path}:{number}: SFT lines must be objects with a non-empty "
                                '"messages" list of {"role", "content"}')
            for m in messages:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                        and isinstance(m.get("content"), str)):
                    raise DataError(f"{path}:{number}: a message {m!r} is not "
                                    '{"role": string, "content": string}')
            yield number, messages


def conversations(path: str | Path, tokenizer: str | Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every conversation of an SFT file as (ids, trained), rendered once per process."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"SFT data {str(path)!r} does not exist")
    tok = load_tokenizer(tokenizer)
    d = Path(tokenizer).resolve()
    return _conversations(path.resolve(), _stamp(path), d, tok.digest,
                          _stamp(d / "tokenizer_config.json"), _stamp(d / "chat_template.jinja"))


@lru_cache(maxsize=4)
def _conversations(path: Path, _stamp_text, tokenizer: Path, _digest, _c1, _c2):
    tok = load_tokenizer(tokenizer)
    render = Renderer(tokenizer)
    out = [render_conversation(render, tok, m) for _, m in read_messages(path)]
    if not out:
        raise DataError(f"SFT data {str(path)!r} holds no conversations")
    return out


def pad_id(tokenizer: str | Path) -> int:
    tok = load_tokenizer(tokenizer)
    name = special_tokens(tokenizer).get("pad_token")
    pid = tok.tokenizer.token_to_id(name) if name else None
    return pid if pid is not None else (tok.eos_id if tok.eos_id is not None else 0)


def pack(convs, width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, trained), each (windows, width): whole conversations per window, in order."""
    rows_ids, rows_trained = [], []
    ids_row, trained_row = [], []

    def close():
        n = sum(len(x) for x in ids_row)
        rows_ids.append(np.concatenate([*ids_row, np.full(width - n, pad, np.int64)]))
        rows_trained.append(np.concatenate([*trained_row, np.zeros(width - n, bool)]))
        ids_row.clear()
        trained_row.clear()

    used = 0
    for ids, trained in convs:
        ids, trained = ids[:width], trained[:width].copy()
        if not len(ids):
            continue
        trained[0] = False                # nothing predicts a conversation from the one before
        if used + len(ids) > width:
            close()
            used = 0
        ids_row.append(ids)
        trained_row.append(trained)
        used += len(ids)
    if ids_row:
        close()
    return np.stack(rows_ids), np.stack(rows_trained)


class SFTWindows:
    """Packed SFT windows: sample ``i`` is window ``i mod windows`` with its loss mask."""

    masked = True

    def __init__(self, path: str, tokenizer: str, seq_len: int, vocab_size: int):
        convs = conversations(path, tokenizer)
        self.tokens, self.trained = pack(convs, seq_len + 1, pad_id(tokenizer))
        self.windows = len(self.tokens)
        top = int(self.tokens.max())
        if top >= vocab_size:
            raise DataError(f"SFT data {path!r} rendered with {tokenizer} holds token id {top}, "
                            f"outside the model's vocabulary of {vocab_size:,}")

    def example(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = index % self.windows
        return (torch.from_numpy(self.tokens[w]),
                torch.from_numpy(self.trained[w][1:].copy()))
