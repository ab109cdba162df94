"""Minimal chat templates, written for the tests, that behave as three real families do on tool conversations:
Qwen2.5's (tools in the system prompt, <tool_response> blocks in a user turn), Qwen3's (the same, and <think>...
</think> stripped from assistant turns before the last user message) and Llama 3's (headers, an ipython role for
tool output, <|eot_id|> ending a turn)."""

_TOOLS_SYSTEM = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    '{%- endfor %}{{- \'\\n</tools>\\nCall one as <tool_call>{"name": n, "arguments": {...}}</tool_call>\' }}'
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_TOOL_MESSAGE = (
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)
_GEN = "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"

QWEN25_LIKE = (
    _TOOLS_SYSTEM
    + "{%- for m in messages %}{%- if false %}"
    + _TOOL_MESSAGE
    + "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    + _GEN
)

QWEN3_LIKE = (
    _TOOLS_SYSTEM + "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    + "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in m.content %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    + _TOOL_MESSAGE
    + "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    + _GEN
)

LLAMA3_LIKE = (
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:' }}{%- for t in tools %}"
    "{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + "
    "'<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
