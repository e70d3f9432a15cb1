"""Stop strings, found incrementally in each row's decoded text as its tokens arrive.

A token's text is what decoding it adds to the text decoded so far; decoding a few tokens back
gives tokenizers that merge spaces or bytes across tokens their context, and a piece that ends
in an incomplete UTF-8 character waits for the next token. A row's text is never re-decoded
whole: each stop check looks at the tail of the text (as long as the longest stop string, less
one) and the new piece.
"""

REPLACEMENT = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence


class IncrementalText:
    """A row's output text, one token at a time, as tokenizer.decode(ids, skip_special_tokens=True)
    of all its tokens would give it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the context the next piece is decoded after

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """The text `token` adds ("" while a character is incomplete)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if text.endswith(REPLACEMENT) or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


class StopStrings:
    """One row's stop strings. add(token) -> the text's length up to the end it keeps, once a
    stop string has completed (the text up to the stop string's start, or its end with
    include), else None."""

    def __init__(self, stops: tuple[str, ...], tokenizer, include: bool = False):
        self.stops, self.include = stops, include
        self.text = IncrementalText(tokenizer)
        self.tail = ""  # the text's last len(longest stop) - 1 characters
        self.length = 0  # characters of text so far
        self.longest = max(map(len, stops))

    def add(self, token: int) -> int | None:
        piece = self.text.add(token)
        if not piece:
            return None
        window, start = self.tail + piece, self.length - len(self.tail)  # window's offset in the text
        found = [(at + len(s), at, s) for s in self.stops if (at := window.find(s)) >= 0]
        self.length += len(piece)
        self.tail = window[max(0, len(window) - self.longest + 1) :]
        if not found:
            return None
        end, at, stop = min(found)  # the stop string completed first
        return start + (end if self.include else at)

    def cut(self, tokens: list[int]) -> int | None:
        """Read `tokens` one at a time; where one completes a stop string, drop the ones after it
        (in place) and return where the text ends; None when none completes one."""
        for k, token in enumerate(tokens):
            end = self.add(token)
            if end is not None:
                del tokens[k + 1 :]
                return end
        return None


class StopRows:
    """The batch's rows' stop strings (stops[b]: row b's, () for none; include[b]: keep the stop
    string in the text)."""

    def __init__(self, stops: list[tuple[str, ...]], tokenizer, include: list[bool]):
        self.rows = [StopStrings(s, tokenizer, keep) if s else None for s, keep in zip(stops, include)]

    def cut(self, blocks: list[list[int]]) -> list[int | None]:
        """Each row's new tokens (host ids), cut in place after a stop string completes; per row,
        where its text then ends (None: it goes on)."""
        return [stop.cut(block) if stop else None for stop, block in zip(self.rows, blocks)]

    def select(self, kept: list[int]) -> None:
        self.rows = [self.rows[b] for b in kept]
