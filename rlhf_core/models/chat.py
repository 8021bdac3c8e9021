"""The one place that turns conversations into text and token ids, and finds where a reply ends.

Every stage (SFT, reward-model training, PPO, evaluation) formats dialogues through these functions, so a
reply is scored, imitated and generated in exactly the same surroundings.

Conventions:
- A conversation is a prompt (a sequence of `{"role", "content"}` messages ending with a user turn) and a
  reply (the plain text of the next assistant turn).
- The tokenizer's own chat template renders the prompt, ending with the generation prompt (for SmolLM2:
  "<|im_start|>assistant\\n"), ready for the reply.
- A reply is terminated by the end-of-turn token (`<|im_end|>` for SmolLM2, `<end_of_turn>` for Gemma; the
  eos token for models without one) and nothing after it: generation stops at that token, so training
  sequences end there too.
- SmolLM2's template inserts a default system prompt ("You are a helpful AI assistant named SmolLM,
  trained by Hugging Face") when the dialogue has no system message. We KEEP it: the instruct model was
  fine-tuned with it, and since every stage renders through this module, policy, reference, reward model
  and critic all see the same text. It costs about 20 tokens per sequence.
- Prompt and reply are tokenised separately and concatenated, never tokenised as one string: PPO
  generates reply tokens after the prompt's ids, so training sequences must split at the same boundary
  (BPE could otherwise merge characters across it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

Messages = Sequence[Mapping[str, str]]

# The tokens chat templates close a turn with: ChatML's (SmolLM2) and Gemma's.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>")


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids of prompt + reply + end-of-turn, and where the reply starts (for masking loss to it)."""

    input_ids: list[int]
    reply_start: int


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> str:
    """The token that closes an assistant turn: the first of `END_OF_TURN_TOKENS` in the vocabulary, else eos."""
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        # Fast tokenizers map an unknown token to the unk id instead of failing.
        is_unknown = token_id is None or (token_id == tokenizer.unk_token_id and tokenizer.unk_token != token)
        if not is_unknown:
            return token
    if tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has none of {END_OF_TURN_TOKENS} nor an eos token to end a turn"
        )
    return tokenizer.eos_token


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Id of `end_of_turn_token(tokenizer)`."""
    return tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> str:
    """The dialogue through the chat template, with the generation prompt: the text a reply follows."""
    if not messages:
        raise ValueError("render_prompt: the dialogue has no messages")
    if messages[-1]["role"] == "assistant":
        raise ValueError("render_prompt: the dialogue ends with an assistant turn; a prompt ends with a user turn")
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    return tokenizer.apply_chat_template(
        [dict(message) for message in messages], tokenize=False, add_generation_prompt=True
    )


def render_conversation(tokenizer: PreTrainedTokenizerBase, messages: Messages, reply: str) -> str:
    """Prompt + reply + end-of-turn token: the text of one complete assistant turn in context."""
    return render_prompt(tokenizer, messages) + reply + end_of_turn_token(tokenizer)


def _token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids of `text` with no special tokens added (the template already wrote them as text)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: Messages, max_length: int | None = None) -> list[int]:
    """Ids of `render_prompt`, keeping only the LAST `max_length` tokens: the latest turns matter most."""
    prompt_ids = _token_ids(tokenizer, render_prompt(tokenizer, messages))
    if max_length is None:
        return prompt_ids
    if max_length < 0:
        raise ValueError(f"max_length must not be negative, got {max_length}")
    return prompt_ids[max(0, len(prompt_ids) - max_length) :]


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, reply: str, max_length: int | None = None
) -> EncodedConversation:
    """Ids of `render_conversation` and the index of the reply's first token.

    A dialogue longer than `max_length` loses tokens from the LEFT (its oldest turns) so the whole reply
    and its end-of-turn token survive; a reply that alone exceeds `max_length` is an error, since no
    truncation can keep it.
    """
    reply_ids = _token_ids(tokenizer, reply) + [end_of_turn_id(tokenizer)]
    if max_length is not None and len(reply_ids) > max_length:
        raise ValueError(
            f"the reply has {len(reply_ids)} tokens with its end-of-turn token, more than "
            f"max_length={max_length}; filter such examples or raise max_length"
        )
    prompt_budget = None if max_length is None else max_length - len(reply_ids)
    prompt_ids = encode_prompt(tokenizer, messages, prompt_budget)
    return EncodedConversation(input_ids=prompt_ids + reply_ids, reply_start=len(prompt_ids))


def reply_end_positions(input_ids: Tensor, attention_mask: Tensor, eot_id: int, reply_start: Tensor | int) -> Tensor:
    """Index of the token that ends each reply: where the reward model reads its score.

    That is the first REAL (attention_mask == 1) end-of-turn token at or after the reply start; when the
    reply was cut before its end-of-turn token (length limit), the last real token. Padding is never
    chosen, even when the pad token is the end-of-turn token itself (SmolLM2 pads with `<|im_end|>`), and
    end-of-turn tokens inside the prompt are skipped. Works for left and right padding alike.

    `reply_start` cannot be inferred: the prompt holds the end-of-turn tokens of earlier turns.

    Shapes: input_ids, attention_mask [B, T]; reply_start [B] (or one int for all rows, e.g. the padded
    prompt length in PPO), in the padded coordinates of `input_ids` (after left padding of p tokens, a
    reply starting at s starts at p + s). Returns a LongTensor [B].
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [B, T]"
        )
    batch_size, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch_size, length)
    start = torch.as_tensor(reply_start, device=input_ids.device).reshape(-1, 1)
    real = attention_mask.bool()
    in_reply = real & (positions >= start)
    rows_without_reply = (~in_reply.any(dim=1)).nonzero().flatten().tolist()
    if rows_without_reply:
        raise ValueError(f"rows {rows_without_reply} have no real token at or after reply_start")
    is_end_of_turn = in_reply & (input_ids == eot_id)
    first_end_of_turn = torch.where(is_end_of_turn, positions, length).min(dim=1).values
    last_real = torch.where(real, positions, -1).max(dim=1).values
    return torch.where(is_end_of_turn.any(dim=1), first_end_of_turn, last_real)


def stop_generation_at_end_of_turn(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make `model.generate` stop at the end-of-turn token (and eos) and pad with the tokenizer's pad.

    Chat models end a reply with the end-of-turn token; without this, generation runs on into a made-up
    next user turn.
    """
    stop_ids = [end_of_turn_id(tokenizer)]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop_ids:
        stop_ids.append(tokenizer.eos_token_id)
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
