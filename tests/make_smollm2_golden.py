"""Write tests/data/smollm2_golden.json: the reference's greedy answers to 20 prompts.

The reference is transformers (with accelerate and gguf: the ``reference`` extra, never
installed by CI) loading the same GGUF file as smollm2_135m. Run once, commit the file:

    .venv/bin/python tests/make_smollm2_golden.py

For each prompt: the token ids of the ChatML text (the reference tokenizer's chat template),
the greedy answer's token ids (up to MAX_NEW_TOKENS, or through the first EOS), and at a few
steps the reference's logits for its top TOP token ids. tests/test_smollm2.py compares our
model with them, without transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

MAX_NEW_TOKENS = 24
TOP = 8
#: Steps whose logits are kept: the first, one in the middle, the last.
LOGIT_STEPS = (0, 11, 23)
OUT = Path(__file__).parent / "data" / "smollm2_golden.json"
PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12345 + 6789?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What colour is the sky?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I "
     "help you today?"}, {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Café, naïve, 日本語, emoji 🚀: repeat these words."}],
    [{"role": "user", "content": "Explain gravity to a five year old."}],
    [{"role": "user", "content": "What does HTTP stand for?"}],
    [{"role": "user", "content": "Give me a recipe for pancakes."}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Where is the treasure?"}],
    [{"role": "user", "content": "   spaces   and\ttabs\nand new lines  "}],
    [{"role": "user", "content": "Summarise: The quick brown fox jumps over the lazy dog. "
     "The dog did not react, and the fox ran into the forest."}],
    [{"role": "user", "content": "SELECT * FROM users WHERE id = 42; what does this do?"}],
    [{"role": "user", "content": "Count from 1 to 10."}],
    [{"role": "user", "content": "Who wrote Hamlet?"}],
    [{"role": "user", "content": "x"}],
    [{"role": "user", "content": "Describe the colour blue without using the word blue, in "
     "a long and detailed paragraph that goes on for a while."}],
]


def main() -> None:
    from redbatch.handlers.smollm2 import gguf_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    cases = [answer(model, tok, messages) for messages in PROMPTS]
    OUT.write_text(json.dumps({"max_new_tokens": MAX_NEW_TOKENS, "cases": cases}, indent=1,
                              ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(cases)} prompts", file=sys.stderr)


@torch.inference_mode()
def answer(model: object, tok: object, messages: list[dict[str, str]]) -> dict[str, object]:
    text = tok.apply_chat_template(messages, tokenize=False,  # type: ignore[attr-defined]
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    seq, out, logits, past = list(ids), [], [], None
    step_ids = torch.tensor([ids])
    for step in range(MAX_NEW_TOKENS):
        result = model(input_ids=step_ids, past_key_values=past,  # type: ignore[operator]
                       use_cache=True)
        past, row = result.past_key_values, result.logits[0, -1]
        token = int(row.argmax())
        if step in LOGIT_STEPS:
            top = row.topk(TOP).indices.tolist()
            logits.append({"step": step, "ids": top, "values": [float(row[i]) for i in top]})
        out.append(token)
        seq.append(token)
        if token == 2:
            break
        step_ids = torch.tensor([[token]])
    return {"messages": messages, "text": text, "input_ids": ids, "output_ids": out,
            "output_text": tok.decode(out, skip_special_tokens=True),  # type: ignore[attr-defined]
            "logits": logits}


if __name__ == "__main__":
    main()
