"""What is asked: the call's options and their vocabulary, their validation, the problem they describe, the
masks' meaning and the target GPU. No kernel, no policy."""
