"""What a run shows: console lines and progress bars (`console`), metrics sinks and the summary file
(`sinks`), plots (`plot`). Low in the stack: every layer may report; it imports none of them."""
