"""The reserved token ids that the tokenizer, the masks, the models and the
decoders agree on.

``PAD`` is padding and also the decoder's start symbol (``shift_right``
puts it in front of every target), so the model never needs a BOS id; a
decoder-only model reuses ``EOS`` as the separator between source and target.
"""
PAD = 0
EOS = 1
UNK = 2
