"""dsec's FastAPI application and its authentication: the apiserver's routes and every face
mounted on one app."""
