"""Chat rows as clients write them: typed content parts, tool calls and tool turns, tools and
documents, and the chat template's options, rendered by the target's chat template (or one
given) exactly as `tokenizer.apply_chat_template` renders them."""

import functools
import json
import os
import resource
import select
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import jinja2
from jinja2 import nodes

from batchspec.errors import UsageError

PART_SEPARATOR = "\n"  # text parts are joined with this for templates that take strings (as vLLM joins them)
CHAT_KEYS = ("tools", "tool_choice", "documents", "chat_template", "chat_template_kwargs", "add_generation_prompt",
             "continue_final_message")  # the body keys chat_request reads
TOOL_CHOICES = ("auto", "none")  # "none": the tools stay out of the prompt; forcing a call needs a grammar
# apply_chat_template's own parameters (and the template's `messages`): not settable through chat_template_kwargs
RESERVED_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatError(ValueError):
    """A chat that cannot be rendered: its error record's type and message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat is rendered: the run's (--chat-template, --chat-template-kwargs,
    --continue-final-message) with a request's own keys over them (`over`)."""

    template: str | None = None  # Jinja source replacing the tokenizer's
    kwargs: dict = field(default_factory=dict)  # extra template variables (chat_template_kwargs)
    add_generation_prompt: bool | None = None  # None: open an assistant turn unless continuing the final message
    continue_final_message: bool = False  # leave the final (assistant) message open for the model to continue
    tools: list | None = None
    documents: list | None = None

    def over(self, row: dict) -> "TemplateOptions":
        """These options with a row's (`chat_request`'s) over them; template kwargs merge."""
        return replace(self, **{**row, "kwargs": {**self.kwargs, **row.get("kwargs", {})}}) if row else self

    @property
    def generation_prompt(self) -> bool:
        return not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt


def check_kwargs(kwargs, name: str) -> dict:
    if not isinstance(kwargs, dict):
        raise ValueError(f"{name} must be an object")
    reserved = sorted(kwargs.keys() & RESERVED_KWARGS)
    if reserved:
        raise ValueError(f"{name} cannot set {', '.join(map(repr, reserved))} (the renderer's own arguments)")
    return kwargs


def chat_request(body: dict) -> dict:
    """The template options of a /v1/chat/completions body, named as TemplateOptions names them
    (ValueError when one is bad)."""
    row = {}
    for key in ("tools", "documents"):
        value = body.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise ValueError(f"{key} must be a list of objects")
        if value:
            row[key] = value
    choice = body.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice {json.dumps(choice)} (forcing a tool call) is not supported by batchspec "
                         "yet (structured outputs); use 'auto' or 'none'")
    if choice == "none":
        row.pop("tools", None)
    if body.get("chat_template") is not None:
        if not isinstance(body["chat_template"], str) or not body["chat_template"]:
            raise ValueError("chat_template must be a non-empty string (a Jinja template)")
        row["template"] = body["chat_template"]
    if body.get("chat_template_kwargs") is not None:
        row["kwargs"] = check_kwargs(body["chat_template_kwargs"], "chat_template_kwargs")
    for key in ("add_generation_prompt", "continue_final_message"):
        if body.get(key) is not None:
            if not isinstance(body[key], bool):
                raise ValueError(f"{key} must be a boolean")
            row[key] = body[key]
    if row.get("add_generation_prompt") and row.get("continue_final_message"):
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    return row


def renders(key: str, value) -> bool:
    """Whether a chat key's value would change a rendered chat (a completions body may carry the others)."""
    off = {"tool_choice": TOOL_CHOICES, "add_generation_prompt": (True,)}.get(key, ([], {}, False))
    return value is not None and value not in off


def content_of(content, where: str, parts: bool) -> str | list[dict]:
    """A message's content as the template takes it: a string as it is; typed parts checked
    (text only) and, for a template that takes parts (`parts`), kept, else their texts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError("invalid_messages", f"{where}.content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ChatError("invalid_messages", f"{where}.content[{j}] must be an object with a string 'type'")
        if kind != "text":
            raise ChatError("invalid_request", f"{where}.content[{j}] is a {kind!r} part; the target is a text "
                            "model, so only 'text' parts can be given")
        if not isinstance(part.get("text"), str):
            raise ChatError("invalid_messages", f"{where}.content[{j}] is a text part without a string 'text'")
        texts.append(part["text"])
    return [{"type": "text", "text": text} for text in texts] if parts else PART_SEPARATOR.join(texts)


def tool_call(call, where: str) -> dict:
    """An OpenAI tool call with its JSON `arguments` string parsed, as chat templates expect them."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise ChatError("invalid_messages", f"{where} must be an object with a 'function' holding a string 'name'")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ChatError("invalid_messages", f"{where}.function.arguments is not valid JSON") from None
    return {**call, "function": {**function, "arguments": arguments}}


def normalized(message: dict, where: str, developer: bool, parts: bool) -> dict:
    """One message as the template takes it: content a string (or text parts, when `parts`),
    tool calls' arguments objects, and the developer role as system unless the template knows
    it (`developer`)."""
    out = dict(message)
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ChatError("invalid_messages", f"{where}.tool_calls must be a list")
        out["tool_calls"] = [tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if message.get("content") is not None or not calls:  # an assistant turn may be its tool calls alone
        out["content"] = content_of(message.get("content"), where, parts)
    if message["role"] == "developer" and not developer:
        out["role"] = "system"
    return out


@dataclass(frozen=True)
class Bounds:
    """What rendering a request's own chat template may take: it runs in a child process, so a
    template that loops, or that builds a huge string, costs that row and nothing else."""

    seconds: float = 5.0  # wall time
    memory: int = 512 << 20  # bytes the child may grow by
    chars: int = 1 << 24  # characters of rendered text


NO_TEMPLATE = ("the target's tokenizer has no chat template, so chat rows (messages, --chat) cannot be rendered; "
               "give plain prompts, a chat model or --chat-template FILE")


def render(tokenizer, messages: list[dict], options: TemplateOptions, system: str | None = None,
           bounds: Bounds | None = None) -> list[int]:
    """Token ids of a chat (a list of objects with a string role, as sources checked it), with
    `system` added when it has no system (or developer) message; rendered within `bounds` when
    given. Raises ChatError for a chat the template cannot take, or when there is no template
    (the row's error: the run's other rows may be plain prompts)."""
    if not (options.template or tokenizer.chat_template):
        raise ChatError("invalid_messages", NO_TEMPLATE)
    try:
        source = tokenizer.get_chat_template(options.template, options.tools)  # the one apply_chat_template uses
    except ValueError as e:  # several named templates, none the default
        raise UsageError(f"cannot render chat rows: {e}") from None
    developer = "developer" in source  # the template names the role: pass it through
    chat = [normalized(m, f"messages[{k}]", developer, takes_parts(source)) for k, m in enumerate(messages)]
    if system is not None and chat[0]["role"] not in ("system", "developer"):
        chat = [{"role": "system", "content": system}, *chat]
    text = apply(tokenizer, chat, options, bounds)
    for name in ("tools", "documents"):
        if getattr(options, name) and apply(tokenizer, chat, replace(options, **{name: None}), bounds) == text:
            raise ChatError("invalid_request", f"the chat template does not render {name}; remove them or give "
                            "a template that does (chat_template, --chat-template)")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def reads_content(node: nodes.Node) -> bool:
    """node is x.content or x["content"] (through filters, e.g. content | selectattr(...))."""
    while isinstance(node, nodes.Filter):
        node = node.node
    return (isinstance(node, nodes.Getattr) and node.attr == "content") or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")


@functools.lru_cache(maxsize=64)
def takes_parts(template: str) -> bool:
    """Whether a template loops over a message's content, directly or through a variable set to
    it: it takes OpenAI content parts (vLLM's test for its "openai" content format). One that
    does not parse here (a tag of transformers' own) is taken to want strings."""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    aliases = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and reads_content(a.node)}
    return any(reads_content(loop.iter) or isinstance(loop.iter, nodes.Name) and loop.iter.name in aliases
               for loop in tree.find_all(nodes.For))


def apply(tokenizer, chat: list[dict], options: TemplateOptions, bounds: Bounds | None = None) -> str:
    """The chat's text as apply_chat_template renders it (which then tokenizes it without special
    tokens), in a child process within `bounds` when given. Whatever the template raises is the
    row's ChatError."""
    if bounds is not None:
        return apply_bounded(tokenizer, chat, options, bounds)
    try:
        return tokenizer.apply_chat_template(
            chat, tools=options.tools, documents=options.documents, chat_template=options.template,
            add_generation_prompt=options.generation_prompt, continue_final_message=options.continue_final_message,
            tokenize=False, **options.kwargs)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError("invalid_request", f"the chat template does not compile: line {e.lineno}: {e.message}") from e
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ChatError("invalid_messages", f"the chat template cannot render this chat: {e}") from e
    except Exception as e:  # noqa: BLE001 - a template's own runtime error (1/0, recursion, overflow) is its row's
        raise ChatError("invalid_messages", f"the chat template failed on this chat: {type(e).__name__}: {e}") from e


def apply_bounded(tokenizer, chat: list[dict], options: TemplateOptions, bounds: Bounds) -> str:
    """apply() in a forked child that may grow by bounds.memory and write bounds.chars back
    through a pipe; killed when it runs over bounds.seconds. Costs a fork (milliseconds)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, answer, and leave without running the parent's exit handlers
        os.close(read_end)
        try:
            answer = child_render(tokenizer, chat, options, bounds)
            with open(write_end, "wb") as pipe:
                pipe.write(answer)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        answer = read_answer(read_end, bounds)
    finally:
        os.close(read_end)
        os.kill(pid, signal.SIGKILL)  # gone already unless it overran
        os.waitpid(pid, 0)
    if not answer or answer == b"null":  # it overran, or died on the way
        raise ChatError("invalid_request", f"the chat template ran over its bounds ({bounds.seconds:g} s, "
                        f"{bounds.memory >> 20} MiB, {bounds.chars} characters)")
    kind, message = json.loads(answer)
    if kind != "text":
        raise ChatError(kind, message)
    return message


def child_render(tokenizer, chat: list[dict], options: TemplateOptions, bounds: Bounds) -> bytes:
    """In the child: the rendered text, or the ChatError's kind and message, as JSON."""
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # the parent's handlers are not the child's
        signal.signal(stop, signal.SIG_DFL)
    size = address_space()
    if size is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (min(size + bounds.memory, hard), hard))
    try:
        text = apply(tokenizer, chat, options)
        answer = ["text", text] if len(text) <= bounds.chars else None
    except ChatError as e:
        answer = [e.kind, str(e)]
    except MemoryError:
        answer = ["invalid_request", f"the chat template needed over {bounds.memory >> 20} MiB"]
    return json.dumps(answer).encode()


def address_space() -> int | None:
    """This process's virtual memory size in bytes (what RLIMIT_AS limits); None where there is
    no /proc to tell (the time bound still holds there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def read_answer(fd: int, bounds: Bounds) -> bytes | None:
    """What the child wrote, or None when it overran its time or its answer the size bound."""
    deadline, chunks, size = time.monotonic() + bounds.seconds, [], 0
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > 6 * bounds.chars + 64:  # JSON escapes a character in 6 bytes at most
            return None
    return None


def run_template_options(template_file: str | None, kwargs_json: str | None, continue_final_message: bool,
                         tokenizer) -> TemplateOptions:
    """The run's TemplateOptions from --chat-template FILE, --chat-template-kwargs JSON and
    --continue-final-message; a template that does not compile is a usage error."""
    template = None
    if template_file is not None:
        try:
            template = Path(template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --chat-template {template_file}: {e}") from None
    try:
        kwargs = check_kwargs(json.loads(kwargs_json), "--chat-template-kwargs") if kwargs_json else {}
    except ValueError as e:
        raise UsageError(f"--chat-template-kwargs: {e}") from None
    options = TemplateOptions(template=template, kwargs=kwargs, continue_final_message=continue_final_message)
    if template is not None:
        try:  # a probe: only a template that does not compile is the run's error, the rest are rows'
            apply(tokenizer, [{"role": "user", "content": "hi"}], options)
        except ChatError as e:
            if isinstance(e.__cause__, jinja2.TemplateSyntaxError):
                raise UsageError(f"--chat-template {template_file}: {e}") from None
    return options
