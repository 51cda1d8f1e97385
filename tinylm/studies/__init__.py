"""Studies: the source reports reproduced end to end (TinyStories assignment, Shakespeare four-stage study)."""
