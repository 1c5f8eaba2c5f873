"""The error types that reach the user as a single line, never as a traceback, and the texts
that such a line quotes from another error."""

import re


class _OneLineError(Exception):
    """An error whose message reaches the user as one line: TensorFlow's wrapping of an op's
    message that it quotes (`without_op_noise`) is left out here, once for every such error.
    (In __str__, not __init__: autograph re-raises an error traced in a tf.function as its own
    type only if the type keeps Exception's __init__.)"""

    def __str__(self) -> str:
        return without_op_noise(super().__str__())


class UsageError(_OneLineError):
    """Bad input: a flag, a file, the train_dir or the environment.

    The message is one line that names the culprit and what is allowed. The CLI
    prints it as ``tower_train: error: <message>`` and exits with status 2,
    before anything is written.
    """


class TrainingError(_OneLineError):
    """Training cannot go on (a non-finite loss, a lost peer); the message is one line.

    The CLI prints it as ``tower_train: <message>`` and exits with status 1.
    """


class Stopped(_OneLineError):
    """The run was asked to stop (SIGTERM, SIGINT, SIGHUP) and did so at an update boundary, saved.

    The CLI prints the message and exits with 128 + the signal's number, as a
    shell does for a process that a signal ended.
    """

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.exit_status = 128 + signal_number


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's message (TensorFlow's `message` when it has one) that is not
    TensorFlow's wrapping, without the wrapping within it, cut to `limit` characters: what a
    one-line error quotes."""
    for line in (getattr(error, "message", None) or str(error)).splitlines():
        line = _ROOT_ERROR.sub("", without_op_noise(line).strip())
        if line and not _OP_NOISE_LINE.fullmatch(line):
            return line[:limit]
    return type(error).__name__


def traced_message(error: BaseException) -> str:
    """An error's own message without the "in user code:" stack that tf.function writes before
    the message of an error raised while it traces: its last line, less the "<Type>: " there."""
    text = str(error).strip()
    if not text.startswith("in user code:"):
        return text
    last = text.splitlines()[-1].strip()
    prefix = f"{type(error).__name__}: "
    return last.removeprefix(prefix)


# TensorFlow's wrapping of an op's own message: the function and node it ran in, the op that
# raised it, tf.data's "user-defined function" preamble. Removed wherever it stands in a line.
_OP_NOISE = re.compile(r"\{\{function_node [^}]*\}\}|\{\{node [^}]*\}\}|\[Op:[^\]]*\]( name: [\w/.\-]*)?|"
                       r"Error in user-defined function passed to \S+ transformation with iterator: \S+: ")
# Whole lines of it: the headline, where the node was defined (and its stack frames), the
# nodes an error passed through, the count of root errors and of operations.
_OP_NOISE_LINE = re.compile(r"Graph execution error:|Detected at node .*|<stack traces unavailable>|File \".*|\[\[.*\]\]|"
                            r"\d+ root error\(s\) found\.|\d+ successful operations\.|"
                            r"\d+ derived errors ignored\.")
_ROOT_ERROR = re.compile(r"^\(\d+\) [A-Z_]+: +")  # "(0) INVALID_ARGUMENT: " before each root error


def without_op_noise(text: str) -> str:
    """`text` without TensorFlow's wrapping of an op's message (`_OP_NOISE`) wherever it stands,
    and without the spaces that the wrapping stood between."""
    if "{{" not in text and "[Op:" not in text and "user-defined function" not in text:
        return text  # a message of ours: left exactly as written
    text = re.sub(r" {2,}", " ", _OP_NOISE.sub("", text))
    return re.sub(r" ([);,])", r"\1", text.replace("( ", "(")).strip()


def op_error_text(error: BaseException, limit: int = 1000) -> str:
    """The culprit's own words in an error, as one line: for a TensorFlow op error, the op's
    message (an assertion's text and values, a label's value, a file's name and offset) without
    TensorFlow's wrapping around it (function and node names, where the node was defined, the
    same root error repeated per device). Only if what is left exceeds `limit` characters is it
    cut, at a space, so that a name in it is kept whole or left out, never cut."""
    parts: list[str] = []
    in_traceback = False
    for line in (getattr(error, "message", None) or str(error)).splitlines():
        # A py_function's error carries its Python traceback, whose last line repeats the error.
        if line.strip() == "Traceback (most recent call last):":
            in_traceback = True
            continue
        if in_traceback and (not line.strip() or line[0].isspace()):
            continue
        in_traceback = False
        line = _ROOT_ERROR.sub("", without_op_noise(line).strip())
        if line and not _OP_NOISE_LINE.fullmatch(line) and line not in parts:
            parts.append(line)
    text = " ".join("; ".join(parts).split())
    if not text:
        return type(error).__name__
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[:cut if cut > 0 else limit] + " ..."
