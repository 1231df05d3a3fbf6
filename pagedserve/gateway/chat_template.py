"""The chat template's inputs beyond the messages: a request's `chat_template_kwargs` (its own
variables for the template, e.g. Qwen3's `enable_thinking`) and `--chat-template FILE` (a
Jinja template used instead of the model's).

Contract:
- `kwargs(value, param)`: the dict to pass to apply_chat_template (None: none given);
  ValueError naming `param` when it is not an object, or naming a key that is
  apply_chat_template's own argument (`tokenize`, `tools`, ...: the server sets those).
- `kwargs_of_proto(request)`: a gRPC ChatRequest's chat_template_kwargs (a Struct) as a dict.
- `load(path)`: the template text of --chat-template; ValueError saying what is wrong with
  the file (missing, unreadable, not Jinja).
"""
from __future__ import annotations

RESERVED = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
            "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
            "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def kwargs(value, param: str = "chat_template_kwargs") -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):  # a ValueError: the APIs answer it as a bad request
        raise ValueError(f"{param} must be an object of template variables "  # noqa: TRY004
                         '(e.g. {"enable_thinking": false})')
    for key in value:
        if key in RESERVED:
            raise ValueError(f"{param}.{key} is set by the server, not a template variable: leave it out")
    return dict(value)


def kwargs_of_proto(request) -> dict | None:
    struct = getattr(request, "chat_template_kwargs", None)
    if struct is None or not request.HasField("chat_template_kwargs"):
        return None
    from google.protobuf.json_format import MessageToDict

    return kwargs(MessageToDict(struct), "chat_template_kwargs")


def load(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({e}); give a Jinja template file") from None
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)  # as transformers
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {path}: not a Jinja template: {e.message} (line {e.lineno})") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return text
