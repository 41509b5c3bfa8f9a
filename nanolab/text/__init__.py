"""Text to tokens and back (Lab 1 builds it).

`bpe` holds the byte-level BPE algorithm on lists of ids: pair counts, merges, training, encoding.
`tokenizer` wraps it into the `Tokenizer` a model ships with: a regex pre-split, special tokens, the
end-of-text id, decoding to text, a file format, and a tiktoken twin to check it against.
`hf_tokenizer` puts a Hugging Face checkpoint's ``tokenizer.json`` behind the same interface, and
`chat_template` renders a conversation as a prompt with the model's Jinja chat template.
"""
