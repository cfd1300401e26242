"""The ids of the special symbols, fixed for the whole project: the tokenizer gives them to its pieces,
the model masks PAD_ID, decoding starts from BOS_ID and ends at EOS_ID."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_IDS = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
