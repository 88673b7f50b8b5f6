"""The tiny test model, taught to think first: a real mlx-lm model whose chat template opens a
thinking block (`<think>`) at the end of the generation prompt, as Qwen3's does, unless
`enable_thinking` is false (then the block comes already closed: `<think></think>`). Its greedy
output is one thought token, `</think>`, then the tiny model's ordinary text.

mlx-lm finds the markers in the vocabulary (has_thinking, think_start / think_end), as it does
for Qwen3, DeepSeek-R1 and the like; the chain is taught as in tool_model.py.
"""

from __future__ import annotations

import pathlib

from tests.support.tiny_model import make_tiny_model
from tests.support.tool_model import add_chain

THINKING_MODEL_ID = "exo-test/tiny-thinking"
THINK_START, THINK_END = "<think>", "</think>"
THOUGHT = "The user asks about the sea; keep it short."  # one token

THINKING_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}" + THINK_START + THINK_END +
    "{% else %}" + THINK_START + "{% endif %}{% endif %}"
)


def make_thinking_model(path: pathlib.Path) -> pathlib.Path:
    path = make_tiny_model(pathlib.Path(path))
    chain = [THINK_START, THOUGHT, THINK_END]  # after THINK_END: no slot, the tiny model's own text
    return add_chain(path, [THINK_START, THINK_END], [THOUGHT], chain, blocked=chain, template=THINKING_TEMPLATE)
