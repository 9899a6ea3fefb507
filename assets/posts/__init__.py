"""The generated regions of blogs/ and devlog/ (assets/make_posts.py): the manual and the code's layout are in
README.md beside this file."""
