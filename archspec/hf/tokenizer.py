"""`ByteTokenizer`: the tokenizer of archspec's byte-level models (the `bytes_lm` task).

Token id = byte value (0-255) of the UTF-8 text, nothing added: exactly how `bytes_lm`
feeds the model. The vocabulary has no spare id, so the end-of-text token is the NUL
byte (id 0), which the training text never contains; there is no padding token of its
own (padding reuses it, and the attention mask says what is real).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizer

BYTES = 256
EOS_BYTE = "\x00"


class ByteTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, eos_token: str = EOS_BYTE, pad_token: str = EOS_BYTE, **kwargs) -> None:
        super().__init__(eos_token=eos_token, pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return BYTES

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(BYTES)}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        return ord(token) if len(token) == 1 and ord(token) < BYTES else 0

    def _convert_id_to_token(self, index: int) -> str:
        return chr(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens if len(t) == 1 and ord(t) < BYTES).decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None) -> list[int]:
        return token_ids_0 if token_ids_1 is None else token_ids_0 + token_ids_1

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # the vocabulary is the 256 bytes: nothing to write
