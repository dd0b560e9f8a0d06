"""ChatML chat templates with Hermes-style tool calling, for the models yieldgate makes.

The layout is the one vLLM's `hermes` tool parser reads (Qwen2.5 / Hermes-2-Pro): tools as JSON lines
in <tools> inside the system turn, an assistant's calls as <tool_call>{"name", "arguments"}</tool_call>,
tool results as <tool_response> blocks in a user turn, the developer role as a system turn, content
part arrays as their text parts. The gateway renders the same template to tokenize chats exactly.
"""

from __future__ import annotations

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\n</tool_call>'
)
_TOOLS_BLOCK = (
    "{{ '" + _TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_FORMAT + "' }}"
)
_TEXT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
)
_NO_SYSTEM = "not (messages and messages[0]['role'] in ['system', 'developer'])"


def chatml_template(bos: bool, default_system: str = "") -> str:
    """The Jinja chat template. `bos`: the template emits the BOS token first (chat prompts are then
    tokenized without special tokens, as vLLM does). `default_system`: the system turn a chat without
    one gets (the model was trained with it); tools, if any, follow it in that turn."""
    if default_system:
        assert "'" not in default_system and "{" not in default_system
        opening = (
            f"{{% if {_NO_SYSTEM} %}}"
            "{{ '<|im_start|>system\n" + default_system + "' }}"
            "{% if tools %}{{ '\n\n' }}" + _TOOLS_BLOCK + "{% endif %}"
            "{{ '<|im_end|>\n' }}"
            "{% endif %}"
        )
    else:
        opening = (
            f"{{% if tools and {_NO_SYSTEM} %}}"
            "{{ '<|im_start|>system\n' }}" + _TOOLS_BLOCK + "{{ '<|im_end|>\n' }}"
            "{% endif %}"
        )
    return (
        ("{{ bos_token }}" if bos else "")
        + opening
        + "{% for message in messages %}"
        "{% if message['role'] == 'tool' %}"
        "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
        "{{ '\n<tool_response>\n' }}" + _TEXT + "{{ '\n</tool_response>' }}"
        "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
        "{% else %}"
        "{{ '<|im_start|>' + ('system' if message['role'] == 'developer' else message['role']) + '\n' }}"
        + _TEXT
        + "{% if loop.first and tools and message['role'] in ['system', 'developer'] %}{{ '\n\n' }}" + _TOOLS_BLOCK + "{% endif %}"
        "{% if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
        "{% for call in message['tool_calls'] %}"
        "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
        "{{ '<tool_call>\n' }}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
        "{{ '\n</tool_call>' }}"
        "{% endfor %}"
        "{% endif %}"
        "{{ '<|im_end|>\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
