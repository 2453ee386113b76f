"""The node agent's block table (``pool``) and its sequenced event log (``events``)."""
