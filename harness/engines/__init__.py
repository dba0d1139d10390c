"""Engines: the one small interface every inference engine implements (`base`), the registry that
finds them (`registry`), and one module per engine. A new engine is one new file: a module here, or
in any installed package named under the `harness.engines` entry-point group, that defines
`ENGINE = SomeEngine`. Everything the rest of the harness needs to know of an engine (its options,
which axes it honours, ignores or refuses, what doctor probes, how to install it) is on that class.

May import: `harness.core`, `harness.models`. Never the experiment, results or anything above.
"""
