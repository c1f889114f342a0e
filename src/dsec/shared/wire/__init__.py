"""The wire models: what crosses between the SDK and the apiserver, and between the
apiserver and an edge. Only pydantic and the standard library: the SDK depends on this
package and on nothing of the server's (models: sandboxes, exec, files, FnCall, nodes;
layers: the layer catalog's entries; iam: tokens; edge: the edge contract's process,
watch, HTTP and TTY items)."""
