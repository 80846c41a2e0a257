"""Greedy continuation of a prompt with an exported model and its tokenizer (transformers, offline).

    python examples/generate.py exports/continued "in the beginning was the word"

Loads the folder with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
(``unbubble export`` copies the tokenizer the run trained on beside the weights), and prints the
prompt's greedy continuation and the largest logit of each generated token.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a folder unbubble export wrote (or any local HF model with its tokenizer)")
    parser.add_argument("prompt", help="the text to continue")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.folder, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.folder, local_files_only=True).eval()
    prompt = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**prompt, max_new_tokens=args.new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out.sequences[0, prompt["input_ids"].shape[1]:]
    print(f"{args.prompt} | {tokenizer.decode(new)}")
    print("largest logit per new token: " + ", ".join(f"{lg.max().item():.3f}" for lg in out.logits))


if __name__ == "__main__":
    main()
