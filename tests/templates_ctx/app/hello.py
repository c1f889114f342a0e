import six

print("hello from the template", six.__version__)
