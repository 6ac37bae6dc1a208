"""What every package of tiergate may import: small rules each would otherwise write again.

It imports nothing of ours (pyproject's import contracts), so scheduler/ and billing/, which import
nothing of the project's other packages, may still use it. `env`: the TIERGATE_* environment's one
parser and the variables no gateway setting carries; `errors`: an exception's one-line summary.
"""
