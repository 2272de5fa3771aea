"""The conformance kit's checks (collected only under ``--vllite-platform``)."""
