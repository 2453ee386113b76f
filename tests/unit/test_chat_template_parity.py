"""The chat-template renderer against the reference renderer (``transformers``), on
templates with tools in the three families the tool-call parsers read.

The three templates below are this project's own, written to each family's prompt
format (Llama 3.x's JSON calls with an ``ipython`` role; Qwen2.5's ``<tools>`` /
``<tool_call>`` / ``<tool_response>`` tags with grouped tool results; a Hermes-style
prompt that renders parameters as Python type hints through a recursive macro), and
they use what the published templates of those families use: ``tojson`` with and
without ``indent``, ``strftime_now``, ``raise_exception``, ``namespace``, slicing,
``loop.previtem`` / ``loop.nextitem``, recursive macros, ``|items`` / ``|dictsort``,
``is defined`` / ``is string`` / ``is mapping`` tests. Third-party template text is not
committed here; to check the real ones (or any template a deployment serves), put
them in a folder as ``*.jinja`` files and run::

    KVC_CHAT_TEMPLATES_DIR=/path/to/templates \
        .venv/bin/pytest tests/unit/test_chat_template_parity.py

Every conversation is rendered both with and without the generation prompt; a
template that raises (``raise_exception``, or a template bug) must raise in both.
Content parts are not exercised here: the conductor joins text parts into one string
before rendering (``_normalise_content``), ``transformers`` passes them through.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvc.models import DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTemplateError, ChatTokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_JSON_STYLE = r"""
{{- bos_token }}
{%- set tools = tools if tools is defined else none %}
{%- set today = date_string if date_string is defined else strftime_now("%d %b %Y") %}
{%- if messages and messages[0].role == "system" %}
    {%- set system = messages[0].content | trim %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = "" %}
    {%- set rest = messages %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Today Date: " ~ today ~ "\n\n" }}
{%- if tools is not none %}
    {{- 'To call a function, answer {"name": function name, "parameters": arguments}.\n\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system ~ "<|eot_id|>" }}
{%- for m in rest %}
    {%- if m.role == "tool" or m.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- {"output": m.content} | tojson }}
        {{- "<|eot_id|>" }}
    {%- elif m.tool_calls is defined and m.tool_calls %}
        {%- if m.tool_calls | length > 1 %}
            {{- raise_exception("one tool call per assistant turn") }}
        {%- endif %}
        {%- set call = m.tool_calls[0].function %}
        {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
        {{- '{"name": "' ~ call.name | trim ~ '", "parameters": ' ~ call.arguments | tojson ~ "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>" ~ m.role ~ "<|end_header_id|>\n\n" }}
        {{- m.content | trim ~ "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
{%- endif %}
"""

QWEN25_TAGS_STYLE = r"""
{%- set ns = namespace(system="You are a helpful assistant.", start=0) %}
{%- if messages and messages[0].role == "system" %}
    {%- set ns.system = messages[0].content %}
    {%- set ns.start = 1 %}
{%- endif %}
{{- "<|im_start|>system\n" ~ ns.system }}
{%- if tools %}
    {{- "\n\n# Tools\n\nFunction signatures within <tools></tools> tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" ~ tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>' }}
{%- endif %}
{{- "<|im_end|>\n" }}
{%- for m in messages[ns.start:] %}
    {%- if m.role == "assistant" and m.tool_calls %}
        {{- "<|im_start|>assistant" }}
        {%- if m.content %}
            {{- "\n" ~ m.content }}
        {%- endif %}
        {%- for call in m.tool_calls %}
            {%- set f = call.function if call.function is defined else call %}
            {{- "\n<tool_call>\n" ~ {"name": f.name, "arguments": f.arguments} | tojson }}
            {{- "\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\n" }}
    {%- elif m.role == "tool" %}
        {%- if loop.first or loop.previtem.role != "tool" %}
            {{- "<|im_start|>user" }}
        {%- endif %}
        {{- "\n<tool_response>\n" ~ m.content ~ "\n</tool_response>" }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- "<|im_end|>\n" }}
        {%- endif %}
    {%- else %}
        {{- "<|im_start|>" ~ m.role ~ "\n" ~ m.content ~ "<|im_end|>\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\n" }}
{%- endif %}
"""

HERMES_MACRO_STYLE = r"""
{%- macro py_type(spec) -%}
    {%- set simple = {"string": "str", "integer": "int", "number": "float", "boolean": "bool"} -%}
    {%- if spec.type is string and spec.type in simple -%}
        {{- simple[spec.type] -}}
    {%- elif spec.type == "array" -%}
        {{- "list[" ~ (py_type(spec["items"]) if spec["items"] is defined else "Any") ~ "]" -}}
    {%- elif spec.type == "object" and spec.additionalProperties is mapping -%}
        {{- "dict[str, " ~ py_type(spec.additionalProperties) ~ "]" -}}
    {%- elif spec.type == "object" -%}
        {{- "dict" -}}
    {%- elif spec.type is sequence and spec.type is not string -%}
        {{- "Union[" -}}
        {%- for t in spec.type -%}
            {{- py_type({"type": t}) if t != "null" else "None" -}}
            {{- ", " if not loop.last -}}
        {%- endfor -%}
        {{- "]" -}}
    {%- else -%}
        {{- "Any" -}}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if tools is iterable and tools | length > 0 %}
    {{- "<|im_start|>system\nYou may call these functions (<tools></tools>):\n<tools>\n" }}
    {%- for tool in tools %}
        {%- set f = tool.function if tool.function is defined else tool %}
        {{- "def " ~ f.name ~ "(" }}
        {%- for name, spec in f.parameters.properties | items %}
            {{- name ~ ": " ~ py_type(spec) }}
            {{- ", " if not loop.last }}
        {%- endfor %}
        {{- "):\n    " ~ f.description | trim }}
        {%- for name, spec in f.parameters.properties | dictsort %}
            {%- if loop.first %}
                {{- "\n    Args:" }}
            {%- endif %}
            {{- "\n        " ~ name ~ ": " ~ spec.description | default("") | trim }}
        {%- endfor %}
        {{- "\n" }}
    {%- endfor %}
    {{- "</tools>\nAnswer a call as <tool_call>{...}</tool_call>.<|im_end|>\n" }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == "assistant" and m.tool_calls is defined and m.tool_calls %}
        {{- "<|im_start|>assistant" }}
        {%- for call in m.tool_calls %}
            {{- "\n<tool_call>\n" ~ call.function | tojson ~ "\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\n" }}
    {%- elif m.role == "tool" %}
        {%- if m.name is not defined %}
            {{- raise_exception("a tool result needs the name of the function it answers") }}
        {%- endif %}
        {{- "<|im_start|>tool\n<tool_response>\n" }}
        {{- {"name": m.name, "content": m.content} | tojson ~ "\n</tool_response><|im_end|>\n" }}
    {%- else %}
        {{- "<|im_start|>" ~ m.role ~ "\n" ~ m.content ~ "<|im_end|>\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\n" }}
{%- endif %}
"""

TEMPLATES = {
    "llama3-json": LLAMA3_JSON_STYLE,
    "qwen2.5-tags": QWEN25_TAGS_STYLE,
    "hermes-macro": HERMES_MACRO_STYLE,
}

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": " Current weather — météo, 天气 <now> & 'then' ",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name "},
                "days": {"type": "integer", "description": "Forecast days"},
                "units": {"type": ["string", "null"], "description": "metric or imperial"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "limits": {
                    "type": "object",
                    "additionalProperties": {"type": "number"},
                    "description": "per field",
                },
            },
            "required": ["city"],
        },
    },
}
NO_ARGS: dict[str, Any] = {
    "type": "function",
    "function": {"name": "now", "description": "The time", "parameters": {"type": "object",
                                                                         "properties": {}}},
}  # fmt: skip


def _call(call_id: str, city: str, *, as_text: bool = False) -> dict[str, Any]:
    arguments: Any = {"city": city, "days": 2}
    if as_text:  # OpenAI's wire form: the arguments as a JSON string
        arguments = f'{{"city": "{city}", "days": 2}}'
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip


Conversation = tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]

CONVERSATIONS: list[Conversation] = [
    ("plain", [{"role": "user", "content": "Hello <b>&</b> 'quotes' \"dq\" 🎉"}], None),
    (
        "system, several turns",
        [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "Où est la bibliothèque?"},
            {"role": "assistant", "content": "Là-bas."},
            {"role": "user", "content": "Merci"},
        ],
        None,
    ),
    ("tools, first turn", [{"role": "user", "content": "Weather in Oslo?"}], [WEATHER, NO_ARGS]),
    (
        "tools, one call and its result",
        [
            {"role": "system", "content": "You route calls."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "Oslo")]},
            {
                "role": "tool",
                "tool_call_id": "a",
                "name": "get_weather",
                "content": '{"temp": -3, "sky": "snow <heavy>"}',
            },
        ],
        [WEATHER],
    ),
    (
        "tools, arguments as OpenAI's JSON string",
        [
            {"role": "user", "content": "Weather in Lima?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call("b", "Lima", as_text=True)],
            },
            {"role": "tool", "tool_call_id": "b", "name": "get_weather", "content": "fog"},
        ],
        [WEATHER],
    ),
    (
        "tools, parallel calls, then an answer",
        [
            {"role": "user", "content": "Oslo and Lima?"},
            {
                "role": "assistant",
                "content": "Checking both.",
                "tool_calls": [_call("a", "Oslo"), _call("b", "Lima")],
            },
            {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": "snow"},
            {"role": "tool", "tool_call_id": "b", "name": "get_weather", "content": "fog"},
            {"role": "assistant", "content": "Snow in Oslo, fog in Lima."},
            {"role": "user", "content": "Thanks"},
        ],
        [WEATHER],
    ),
    (
        "a tool result without a name",
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "Oslo")]},
            {"role": "tool", "tool_call_id": "a", "content": "sun"},
        ],
        [WEATHER],
    ),
]

_HF: Any = None
_SHIPPED: list[ChatTokenizer] = []


def _reference() -> Any:
    global _HF
    if _HF is None:
        _HF = transformers.AutoTokenizer.from_pretrained(
            str(DEFAULT_MODEL_DIR), local_files_only=True
        )
    return _HF


def _ours(template: str) -> ChatTokenizer:
    if not _SHIPPED:
        _SHIPPED.append(ChatTokenizer.from_dir(DEFAULT_MODEL_DIR))
    shipped = _SHIPPED[0]
    return ChatTokenizer(
        shipped.tokenizer,
        chat_templates={"default": template},
        bos_token=shipped.bos_token,
        eos_token=shipped.eos_token,
    )


def _render_both(
    template: str, conversation: Conversation, generation_prompt: bool
) -> tuple[str | None, str | None]:
    """(ours, the reference's) rendering; None where the renderer raised."""
    _, messages, tools = conversation
    try:
        want: str | None = _reference().apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=generation_prompt, date_string="26 Nov 2026",
        )  # fmt: skip
    except Exception:  # any failure inside the reference renderer
        want = None
    try:
        got: str | None = _ours(template).apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt,
            template_kwargs={"date_string": "26 Nov 2026"},
        )  # fmt: skip
    except ChatTemplateError:
        got = None
    return got, want


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_family_templates_render_as_the_reference_does(
    family: str, conversation: Conversation, generation_prompt: bool
) -> None:
    got, want = _render_both(TEMPLATES[family], conversation, generation_prompt)
    assert got == want


def test_the_table_reaches_every_branch_it_claims() -> None:
    """The conversations above exercise the templates' tool paths and their refusals
    (so the parity test is not comparing two empty or two failed renderings)."""
    loop = CONVERSATIONS[3]
    llama, _ = _render_both(LLAMA3_JSON_STYLE, loop, True)
    assert llama is not None
    assert '"type": "function",\n    "function": {' in llama  # tojson(indent=4)
    assert '{"output": "{\\"temp\\": -3, \\"sky\\": \\"snow <heavy>\\"}"}' in llama
    assert "Today Date: 26 Nov 2026" in llama
    qwen, _ = _render_both(QWEN25_TAGS_STYLE, CONVERSATIONS[5], True)
    assert qwen is not None
    assert qwen.count("<|im_start|>user\n<tool_response>") == 1
    assert qwen.count("</tool_response><|im_end|>") == 1  # both results in one turn
    hermes, _ = _render_both(HERMES_MACRO_STYLE, CONVERSATIONS[2], True)
    assert hermes is not None
    assert (
        "def get_weather(city: str, days: int, units: Union[str, None], hours: list[int], "
        "limits: dict[str, float]):" in hermes
    )
    # Refusals: raise_exception on both sides.
    assert _render_both(LLAMA3_JSON_STYLE, CONVERSATIONS[5], True) == (None, None)
    assert _render_both(HERMES_MACRO_STYLE, CONVERSATIONS[6], True) == (None, None)


def test_strftime_now_is_the_reference_one() -> None:
    template = '{{ strftime_now("%Y") }}|{{ messages[0].content }}'
    messages = [{"role": "user", "content": "x"}]
    got = _ours(template).apply_chat_template(messages, add_generation_prompt=False)
    want = _reference().apply_chat_template(messages, chat_template=template, tokenize=False)
    assert got == want


_REAL_DIR = os.environ.get("KVC_CHAT_TEMPLATES_DIR", "")
_REAL = sorted(Path(_REAL_DIR).glob("*.jinja")) if _REAL_DIR else []


@pytest.mark.skipif(not _REAL_DIR, reason="set KVC_CHAT_TEMPLATES_DIR to a folder of *.jinja")
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
@pytest.mark.parametrize("path", _REAL or [None], ids=[p.stem for p in _REAL] or ["none"])
def test_real_templates_render_as_the_reference_does(
    path: Path | None, conversation: Conversation, generation_prompt: bool
) -> None:
    assert path is not None, f"no *.jinja in KVC_CHAT_TEMPLATES_DIR={_REAL_DIR}"
    got, want = _render_both(path.read_text(encoding="utf-8"), conversation, generation_prompt)
    assert got == want
