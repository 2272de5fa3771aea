"""The platform conformance kit: the same checks for every platform package, in tree or not.

Run it against an installed platform on its own hardware::

    pytest --vllite-platform NAME            # the pytest11 plugin is auto-loaded
    pytest -p vllite_conformance --vllite-platform NAME   # where plugin autoload is off

It checks that the contract methods answer sensibly, that the platform's
attention backend matches ``vllite_core.attention.reference`` on random paged
inputs, that memory profiling returns a positive bounded number, that graph
capture gives the same logits as eager execution, and that the engine's greedy
tokens on a tiny random Llama are identical with and without graphs, and
identical to Hugging Face transformers. See docs/platforms.md.

``vllite_core.conformance.kit`` holds the reusable pieces (attention cases, the
tiny model, a step driver) for a platform's own tests.
"""

OPTION = "--vllite-platform"
