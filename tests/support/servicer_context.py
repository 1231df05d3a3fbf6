"""A stand-in for grpc.ServicerContext when a test calls a servicer method directly: `abort`
records the code and details and raises Aborted, as grpc's abort ends the call."""


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)
