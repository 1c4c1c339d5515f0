"""Records -> token documents with a loss mask.

A document is `(input_ids, mask)`: `mask[i]` is True where token i is a training target (its label is the token
itself; elsewhere -100). Formats:

  text               {"text": ...}                                       loss_on: all
  alpaca             {"instruction", "input"?, "output"}                 loss_on: all | completion (= the output)
  messages           {"messages": [{"role", "content"}, ...]}            loss_on: all | assistant (= assistant turns)
  prompt_completion  {"prompt", "completion"}                            loss_on: all | completion
                     (strings, or TRL's conversational form: two lists of messages, rendered by the chat template)
  tokens             {"input_ids": [...], "labels"?: [...]}             pre-tokenized (the synthetic source)

Text fields must be strings: a list or a number is refused, never trained as its Python repr.

Assistant-only masks for `messages` are found without relying on `{% generation %}` markers: the chat template
renders messages[:i] (+ generation prompt) and messages[:i+1]; the characters between the two renderings are the
assistant turn i, mapped to tokens through the fast tokenizer's offsets. The renderings must be prefixes of the
full conversation: true of ChatML and Llama 3 templates, and of any conversation with one assistant turn; not of
templates that rewrite earlier turns (Qwen3's drops earlier turns' reasoning, Phi-3's and GPT-OSS's too), where a
multi-turn conversation is refused with the fix. Messages keep every key the template may read (tool_calls,
reasoning_content, name, tool_call_id, ...), not only role and content.
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable

from novatune.data.sources import DataError

FORMATS = ("text", "alpaca", "messages", "prompt_completion", "tokens")
ALPACA_PROMPT = ("Below is an instruction that describes a task{ctx}. Write a response that appropriately completes "
                 "the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n")

Doc = tuple[list[int], list[bool]]


def detect_format(record: dict) -> str:
    keys = set(record)
    if "messages" in keys or "conversations" in keys:
        return "messages"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if "text" in keys:
        return "text"
    if "input_ids" in keys:
        return "tokens"
    raise DataError(f"data.format: cannot tell the format of a record with keys {sorted(keys)}; set data.format "
                    f"to one of {', '.join(FORMATS)} (or rename the fields: text / messages / prompt+completion / "
                    f"instruction+output)")


def check_loss_on(fmt: str, loss_on: str) -> None:
    ok = {"text": ("all",), "tokens": ("all",), "messages": ("all", "assistant", "completion"),
          "alpaca": ("all", "completion", "assistant"), "prompt_completion": ("all", "completion", "assistant")}
    if loss_on not in ok[fmt]:
        raise DataError(f"data.loss_on: {loss_on!r} does not apply to format {fmt!r} (it has no prompt part); "
                        f"set data.loss_on: all, or use the messages / prompt_completion / alpaca format")


def _get(record: dict, key: str, fmt: str):
    if key not in record:
        raise DataError(f"a {fmt} record lacks {key!r} (keys: {sorted(record)}); fix the data or set data.format")
    if record[key] is None:
        raise DataError(f"a {fmt} record has {key!r}: null; fix the data (drop the record or give it a value)")
    return record[key]


def _text(record: dict, key: str, fmt: str) -> str:
    """A text field, which must be a string: str() of a list or a number would train on its Python repr."""
    value = _get(record, key, fmt)
    if not isinstance(value, str):
        raise DataError(f"a {fmt} record has {key!r} of type {type(value).__name__} ({str(value)[:60]!r}); it must "
                        f"be text: fix the data (a list of chat messages belongs in the messages format, or in "
                        f"both prompt and completion as lists)")
    return value


def _encode(tok, text: str, special: bool) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def _eos(tok, ids: list[int], add_eos: bool) -> list[int]:
    if add_eos and tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
        return ids + [tok.eos_token_id]
    return ids


# the roles chat templates know; anything else would render as nothing or as another role (and a conversation
# whose assistant turns are not recognised trains on nothing)
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _normalise_messages(msgs) -> list[dict]:
    out = []
    for i, m in enumerate(msgs):
        if "role" not in m and "from" in m:  # ShareGPT style
            role = {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"])
            m = {"role": role, "content": m.get("value", "")}
        if m["role"] not in CHAT_ROLES:
            raise DataError(f"message {i} has role {m['role']!r}, which chat templates do not know; use one "
                            f"of {', '.join(CHAT_ROLES)} (ShareGPT 'from': human, gpt, system), or rename the role "
                            f"in the data")
        content = m.get("content", "")
        if content is None and m.get("tool_calls"):  # an OpenAI tool-call turn: the template renders the calls
            content = ""
        if not isinstance(content, str):  # null or a parts list: templates need text
            raise DataError(f"message {i} ({m['role']}) has content {content!r}; chat data needs text content in "
                            f"every message: fill it in or drop that message from the data")
        # every other key stays: templates render tool_calls, reasoning_content, name, tool_call_id ... (not the
        # None a Parquet or datasets row gives every key it lacks: templates test `'tool_calls' in message`)
        kept = {k: v for k, v in m.items() if k not in ("from", "value") and v is not None}
        if kept.get("tool_calls"):
            kept["tool_calls"] = [_call_with_parsed_arguments(c) for c in kept["tool_calls"]]
        out.append({**kept, "role": m["role"], "content": content})
    return out


def _call_with_parsed_arguments(call):
    """OpenAI's data keeps a call's arguments as a JSON string; chat templates write them with `| tojson`
    (Llama 3.1, Qwen2.5), which would encode the string a second time: a dict, as transformers' tool-use docs
    give them. A string that is not a JSON object stays as it is."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


def prompt_completion_doc(tok, prompt: str, completion: str, partial: bool, add_eos: bool):
    """(ids, trained mask, the prompt's tokens left out) of a prompt/completion pair as TRL's SFTTrainer tokenises
    it: the prompt alone and the pair as ONE text, the completion starting where the two token lists part.
    Encoding the completion on its own would differ where the tokenizer prefixes every text (SentencePiece's "▁")
    or merges across the boundary (a prompt ending in a space): tokens the model never sees at inference. The third
    item is the prompt's tail that is not a prefix of the whole (empty when the prompt is one). `partial`: the
    prompt is not trained."""
    p = _encode(tok, prompt, True)
    whole = _eos(tok, _encode(tok, prompt + completion, True), add_eos)
    n = len(os.path.commonprefix([p, whole]))  # elementwise on lists: the shared leading tokens
    return whole, [not partial] * n + [True] * (len(whole) - n), p[n:]


def _warn_merged(tok, tail: list[int]) -> None:
    warnings.warn(f"novatune data: a tokenized prompt is not a prefix of its tokenized prompt + completion (here "
                  f"{tok.decode(tail)!r} merges with the completion's start); the completion starts where they part, "
                  "as in TRL. End prompts on a token boundary (e.g. without a trailing space) to train on the context "
                  "the model sees at inference. Shown once per data source", UserWarning, stacklevel=3)


def _render_prefix(render, msgs: list[dict]) -> str:
    try:
        return render(msgs, gen=True)
    except Exception:  # noqa: BLE001 - some templates cannot render an empty conversation
        if msgs:
            raise
        return ""


def messages_doc(tok, msgs: list[dict], loss_on: str, template: str | None, prompt_turns: int | None = None) -> Doc:
    """The conversation rendered by the chat template, with its loss mask: every token, or the assistant turns;
    with `prompt_turns` (TRL's conversational prompt/completion: the first `prompt_turns` messages are the prompt),
    loss_on completion trains everything after the prompt and its generation prompt, loss_on assistant only the
    completion's assistant turns (not a tool's output inside it)."""
    def render(ms, gen=False):
        from jinja2 import TemplateError

        try:
            return tok.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen, chat_template=template)
        except TemplateError as e:  # a syntax error shows at the first render, not when the config is read
            where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise DataError(f"data.chat_template: the chat template fails to render: {type(e).__name__}{where}: "
                            f"{e}; fix the template's jinja syntax, or unset data.chat_template to use the "
                            f"tokenizer's") from None

    full = render(msgs)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if loss_on == "all":
        return ids, [True] * len(ids)
    if prompt_turns is not None:
        before = _render_prefix(render, msgs[:prompt_turns])
        if not full.startswith(before):
            raise DataError("data.chat_template: this template does not render the prompt messages as a prefix of "
                            "the whole conversation (so the completion cannot be located); set data.chat_template "
                            "to a template without history rewriting, or data.loss_on: all")
        if loss_on == "completion":
            return ids, [start >= len(before) for start, _ in enc["offset_mapping"]]
    spans = []  # assistant turns (of the completion, with prompt_turns): TRL's completion and assistant masks
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i < (prompt_turns or 0):
            continue
        before, upto = _render_prefix(render, msgs[:i]), render(msgs[: i + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError("data.chat_template: this template does not render a conversation's first turns as a "
                            "prefix of the whole (so assistant turns cannot be located); set data.chat_template to "
                            "a template without history rewriting, or data.loss_on: all")
        spans.append((len(before), len(upto)))
    mask = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
    return ids, mask


def make_tokenize(fmt: str, tok, loss_on: str = "all", chat_template: str | None = None,
                  add_eos: bool = True) -> Callable[[dict], Doc]:
    """A function record -> (input_ids, mask) for one format."""
    partial = loss_on != "all"

    if fmt == "tokens":
        def f(r):
            ids = list(_get(r, "input_ids", fmt))
            labels = r.get("labels")
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
            if bad is not None:
                raise DataError(f"a tokens record has input_ids entry {bad!r}; token ids are integers >= 0: fix "
                                f"the data")
            if labels is not None and len(labels) != len(ids):
                raise DataError(f"a tokens record has {len(labels)} labels for {len(ids)} input_ids; labels need "
                                f"one entry per token (-100: not trained): fix the data")
            # labels are a mask over the tokens (the loss shifts by one itself, as Hugging Face's does): a label
            # that is another token would be trained as this token, never as itself
            other = next((i for i, (t, lab) in enumerate(zip(ids, labels or ())) if lab != -100 and lab != t), None)
            if other is not None:
                raise DataError(f"a tokens record has labels[{other}] = {labels[other]!r} where input_ids[{other}] = "
                                f"{ids[other]!r}; labels must be the token itself (trained) or -100 (not trained), "
                                "unshifted, as Hugging Face's labels are: fix the data")
            return ids, ([lab != -100 for lab in labels] if labels is not None else [True] * len(ids))
        return f
    if tok is None:
        raise DataError("model.tokenizer: this data needs a tokenizer; set model.tokenizer to a local tokenizer "
                        "folder (or model.name to a local model folder that has one)")
    if fmt == "text":
        def f(r):
            ids = _eos(tok, _encode(tok, _text(r, "text", fmt), True), add_eos)
            return ids, [True] * len(ids)
        return f
    if fmt in ("alpaca", "prompt_completion"):
        warned: list[bool] = []  # the merge warning, once per data source

        def f(r):
            if fmt == "alpaca":
                inp = r.get("input") or ""
                if not isinstance(inp, str):
                    _text(r, "input", fmt)  # raises, naming the field
                prompt = ALPACA_PROMPT.format(ctx=", paired with an input that provides further context" if inp
                                              else "", instruction=_text(r, "instruction", fmt),
                                              input=f"### Input:\n{inp}\n\n" if inp else "")
                completion = _text(r, "output", fmt)
            elif isinstance(r.get("prompt"), list) and isinstance(r.get("completion"), list):
                return _conversational(r)
            else:
                prompt, completion = _text(r, "prompt", fmt), _text(r, "completion", fmt)
            ids, mask, tail = prompt_completion_doc(tok, prompt, completion, partial, add_eos)
            if tail and not warned:
                warned.append(True)
                _warn_merged(tok, tail)
            return ids, mask

        def _conversational(r):  # TRL's conversational prompt/completion: the chat template renders both
            if chat_template is None and not getattr(tok, "chat_template", None):
                raise DataError("data.chat_template: conversational prompt/completion records need a chat "
                                "template and the tokenizer has none; set data.chat_template (text or a .jinja path)")
            prompt, completion = _normalise_messages(r["prompt"]), _normalise_messages(r["completion"])
            return messages_doc(tok, prompt + completion, loss_on, chat_template, prompt_turns=len(prompt))
        return f
    if fmt == "messages":
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise DataError("data.chat_template: the tokenizer has no chat template; set data.chat_template to a "
                            "jinja template (text or a .jinja path), or use a tokenizer that ships one")

        def f(r):
            msgs = _normalise_messages(r["messages"] if "messages" in r else r["conversations"])
            return messages_doc(tok, msgs, loss_on, chat_template)
        return f
    raise DataError(f"data.format: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
