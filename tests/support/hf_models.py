"""Small transformers models of each family bamboo splits (`--model hf:...`): the names
both tiers train and check, and transformers' own class of each."""
from __future__ import annotations

from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

GPT2 = "hf:gpt2:n_layer=3,n_embd=32,n_head=4,n_positions=32,vocab_size=256"
BERT = ("hf:bert:num_hidden_layers=3,hidden_size=32,num_attention_heads=4,intermediate_size=64,"
        "max_position_embeddings=32,vocab_size=257")
LLAMA = ("hf:llama:num_hidden_layers=3,hidden_size=32,num_attention_heads=4,"
         "num_key_value_heads=2,intermediate_size=64,max_position_embeddings=32,vocab_size=256")
HF_MODELS = {"gpt2": (GPT2, GPT2LMHeadModel), "llama": (LLAMA, LlamaForCausalLM),
             "bert": (BERT, BertForMaskedLM)}
