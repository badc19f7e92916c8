"""The article as exercises: stubs to fill in, a checker that names the mistake in the
article's terms, and the learner's own attention and positions plugged into training
(`python -m attnlab.exercises --help`)."""
