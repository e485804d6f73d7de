"""Where the members of a JSON object lie in a text that may still be growing: a tool-call
parser reads a call's name as soon as it is whole and sends its arguments as the model
writes them, character by character, as their own span of the text (so that the
arguments a stream sent and a finished output's are the same text, as the model wrote
it). Only the scanning is done here; the values are checked with `json` once whole."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
LITERALS = ("true", "false", "null")
NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
NUMBER_PREFIX = re.compile(r"-?([0-9]+(\.[0-9]*)?([eE][+-]?[0-9]*)?)?")
STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to the closing quote (or the end)


@dataclass
class Span:
    start: int
    end: int | None  # one past the value's last character; None while it is being written


@dataclass
class ObjectScan:
    members: dict[str, Span]  # the object's own members (not nested ones'), in order
    end: int | None  # one past the closing brace; None while it is open


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """One past the string starting at text[i] (a quote), or None if it is not closed yet.
    (A regular expression skips its body: a call's arguments are mostly long strings, and
    a stream scans them again at every step.)"""
    end = STRING_BODY.match(text, i + 1).end()
    return end + 1 if end < len(text) and text[end] == '"' else None


def value_end(text: str, i: int) -> int | None:
    """One past the JSON value starting at text[i], None if the text ends inside it (a
    number or literal at the very end may go on); ValueError where the text cannot be the
    beginning of one."""
    ch = text[i]
    if ch == '"':
        return string_end(text, i)
    if ch == "{":
        return scan_object(text, i).end
    if ch == "[":
        return _array_end(text, i)
    j = i
    while j < len(text) and text[j] not in WHITESPACE + ",}]":
        j += 1
    token = text[i:j]
    if j == len(text):  # may go on
        if not (NUMBER_PREFIX.fullmatch(token) or any(word.startswith(token) for word in LITERALS)):
            raise ValueError(f"not the beginning of a JSON value: {token!r}")
        return None
    if not (NUMBER.fullmatch(token) or token in LITERALS):
        raise ValueError(f"not a JSON value: {token!r}")
    return j


def _array_end(text: str, i: int) -> int | None:
    i = _skip(text, i + 1)
    if text[i:i + 1] == "]":
        return i + 1
    while i < len(text):
        end = value_end(text, i)
        if end is None:
            return None
        i = _skip(text, end)
        if i >= len(text):
            return None
        if text[i] == "]":
            return i + 1
        if text[i] != ",":
            raise ValueError("array items must be separated by commas")
        i = _skip(text, i + 1)
    return None


def scan_object(text: str, start: int) -> ObjectScan:
    """The members of the object opening at text[start] ("{") so far. ValueError where the
    text is not JSON already (not a quote where a key goes, no colon after it, ...)."""
    if text[start:start + 1] != "{":
        raise ValueError("not an object")
    members: dict[str, Span] = {}
    i = _skip(text, start + 1)
    if text[i:i + 1] == "}":
        return ObjectScan(members, i + 1)
    while i < len(text):
        if text[i] != '"':
            raise ValueError("a member must start with its key")
        key_end = string_end(text, i)
        if key_end is None:
            break
        key = json.loads(text[i:key_end])
        if key in members:  # (json would read the last; a stream has gone by the first)
            raise ValueError(f"the key {key!r} given twice")
        i = _skip(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            raise ValueError("a key must be followed by a colon")
        i = _skip(text, i + 1)
        if i >= len(text):
            break
        span = members[key] = Span(i, value_end(text, i))
        if span.end is None:
            break
        i = _skip(text, span.end)
        if i >= len(text):
            break
        if text[i] == "}":
            return ObjectScan(members, i + 1)
        if text[i] != ",":
            raise ValueError("members must be separated by commas")
        i = _skip(text, i + 1)
    return ObjectScan(members, None)
