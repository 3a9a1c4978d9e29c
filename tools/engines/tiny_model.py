"""Builds a tiny random-weight Llama model with its own tokenizer into a directory, so that an
engine can be started without downloading anything:

    tools/engines/.venv-vllm/bin/python tools/engines/tiny_model.py DIR

Random weights produce arbitrary text, but deterministically: a second generation of the same
prompt, with the KV cache loaded from the store instead of computed, must give the same tokens.
"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SENTENCES = [
    "mooncaked keeps the KV cache of a prompt so that a second request can skip its prefill.",
    "An inference engine stores the key and value tensors of each block under a hash of "
    "its tokens.",
    "The store holds objects in shared memory segments and serves them over a Unix socket.",
    "Blocks of thirty-two tokens are written once and read by any engine process on the node.",
    "The quick brown fox jumps over the lazy dog while the daemon evicts the oldest leases.",
]


def build(directory: str) -> None:
    # A byte-level BPE tokenizer: every input encodes, whatever the training sentences were.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    wrapped.save_pretrained(directory)

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    torch.manual_seed(0)  # the same weights on every build
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py DIR")
    build(sys.argv[1])
    print(sys.argv[1])
