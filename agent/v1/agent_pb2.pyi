from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareRequest(_message.Message):
    __slots__ = ("generation", "layout", "devices", "rendezvous", "devices_per_node", "staging_bytes", "timeout_seconds", "reason", "old_layout", "old_devices", "recover", "restore_step", "failed_devices", "proxies", "checkpoint", "device_nodes", "old_device_nodes")
    class ProxiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OLD_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    OLD_DEVICES_FIELD_NUMBER: _ClassVar[int]
    RECOVER_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    FAILED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    PROXIES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NODES_FIELD_NUMBER: _ClassVar[int]
    OLD_DEVICE_NODES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    layout: str
    devices: _containers.RepeatedScalarFieldContainer[int]
    rendezvous: str
    devices_per_node: int
    staging_bytes: int
    timeout_seconds: float
    reason: str
    old_layout: str
    old_devices: _containers.RepeatedScalarFieldContainer[int]
    recover: bool
    restore_step: int
    failed_devices: _containers.RepeatedScalarFieldContainer[int]
    proxies: _containers.ScalarMap[int, int]
    checkpoint: str
    device_nodes: _containers.RepeatedScalarFieldContainer[str]
    old_device_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., layout: _Optional[str] = ..., devices: _Optional[_Iterable[int]] = ..., rendezvous: _Optional[str] = ..., devices_per_node: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., reason: _Optional[str] = ..., old_layout: _Optional[str] = ..., old_devices: _Optional[_Iterable[int]] = ..., recover: _Optional[bool] = ..., restore_step: _Optional[int] = ..., failed_devices: _Optional[_Iterable[int]] = ..., proxies: _Optional[_Mapping[int, int]] = ..., checkpoint: _Optional[str] = ..., device_nodes: _Optional[_Iterable[str]] = ..., old_device_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("generation", "at_step", "timeout_seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    at_step: int
    timeout_seconds: float
    def __init__(self, generation: _Optional[int] = ..., at_step: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("generation", "step", "pause_seconds", "phase_seconds", "bytes_sent", "bytes_received", "bytes_local", "new_rank")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOCAL_FIELD_NUMBER: _ClassVar[int]
    NEW_RANK_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    pause_seconds: float
    phase_seconds: _containers.ScalarMap[str, float]
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    new_rank: int
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., pause_seconds: _Optional[float] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_local: _Optional[int] = ..., new_rank: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("generation", "stop", "timeout_seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    stop: bool
    timeout_seconds: float
    def __init__(self, generation: _Optional[int] = ..., stop: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("generation", "step", "path", "seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    path: str
    seconds: float
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("generation", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("since_step",)
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    since_step: int
    def __init__(self, since_step: _Optional[int] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("step", "loss", "seconds", "tokens_per_second", "generation", "sample_begin", "sample_end", "end_time", "compute_seconds", "communication_seconds", "redundancy_seconds", "expert_tokens", "forward_seconds", "backward_seconds", "memory_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_END_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REDUNDANCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    seconds: float
    tokens_per_second: float
    generation: int
    sample_begin: int
    sample_end: int
    end_time: float
    compute_seconds: float
    communication_seconds: float
    redundancy_seconds: float
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    forward_seconds: float
    backward_seconds: float
    memory_bytes: int
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., generation: _Optional[int] = ..., sample_begin: _Optional[int] = ..., sample_end: _Optional[int] = ..., end_time: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., communication_seconds: _Optional[float] = ..., redundancy_seconds: _Optional[float] = ..., expert_tokens: _Optional[_Iterable[int]] = ..., forward_seconds: _Optional[float] = ..., backward_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class SwitchReport(_message.Message):
    __slots__ = ("generation", "from_layout", "to_layout", "step", "pause_seconds", "bytes_sent", "bytes_received")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FROM_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TO_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    from_layout: str
    to_layout: str
    step: int
    pause_seconds: float
    bytes_sent: int
    bytes_received: int
    def __init__(self, generation: _Optional[int] = ..., from_layout: _Optional[str] = ..., to_layout: _Optional[str] = ..., step: _Optional[int] = ..., pause_seconds: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "device", "generation", "layout", "devices", "rank", "step", "data_position", "prepared_generation", "prepared_ready", "prepared_error", "last_switch", "steps", "error", "tokens_per_second", "prepared_layout", "prepared_devices", "prepared_committed", "snapshot_steps", "mirror_of", "mirror_steps", "checkpoint", "checkpoint_step", "previous_generation", "previous_layout", "previous_devices", "previous_snapshot_steps", "previous_mirror_of", "previous_mirror_steps", "collective_wait_seconds", "leaving", "leaving_in_seconds")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[StatusResponse.State]
        STANDBY: _ClassVar[StatusResponse.State]
        TRAINING: _ClassVar[StatusResponse.State]
        SWITCHING: _ClassVar[StatusResponse.State]
        FINISHED: _ClassVar[StatusResponse.State]
        LEFT: _ClassVar[StatusResponse.State]
        FAILED: _ClassVar[StatusResponse.State]
        INTERRUPTED: _ClassVar[StatusResponse.State]
        SUSPENDED: _ClassVar[StatusResponse.State]
    STATE_UNSPECIFIED: StatusResponse.State
    STANDBY: StatusResponse.State
    TRAINING: StatusResponse.State
    SWITCHING: StatusResponse.State
    FINISHED: StatusResponse.State
    LEFT: StatusResponse.State
    FAILED: StatusResponse.State
    INTERRUPTED: StatusResponse.State
    SUSPENDED: StatusResponse.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREPARED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREPARED_READY_FIELD_NUMBER: _ClassVar[int]
    PREPARED_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_SWITCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PREPARED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREPARED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    PREPARED_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIRROR_OF_FIELD_NUMBER: _ClassVar[int]
    MIRROR_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_DEVICES_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SNAPSHOT_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_MIRROR_OF_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_MIRROR_STEPS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    LEAVING_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    state: StatusResponse.State
    device: int
    generation: int
    layout: str
    devices: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    step: int
    data_position: int
    prepared_generation: int
    prepared_ready: bool
    prepared_error: str
    last_switch: SwitchReport
    steps: _containers.RepeatedCompositeFieldContainer[StepRecord]
    error: str
    tokens_per_second: float
    prepared_layout: str
    prepared_devices: _containers.RepeatedScalarFieldContainer[int]
    prepared_committed: bool
    snapshot_steps: _containers.RepeatedScalarFieldContainer[int]
    mirror_of: int
    mirror_steps: _containers.RepeatedScalarFieldContainer[int]
    checkpoint: str
    checkpoint_step: int
    previous_generation: int
    previous_layout: str
    previous_devices: _containers.RepeatedScalarFieldContainer[int]
    previous_snapshot_steps: _containers.RepeatedScalarFieldContainer[int]
    previous_mirror_of: int
    previous_mirror_steps: _containers.RepeatedScalarFieldContainer[int]
    collective_wait_seconds: float
    leaving: bool
    leaving_in_seconds: float
    def __init__(self, state: _Optional[_Union[StatusResponse.State, str]] = ..., device: _Optional[int] = ..., generation: _Optional[int] = ..., layout: _Optional[str] = ..., devices: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., data_position: _Optional[int] = ..., prepared_generation: _Optional[int] = ..., prepared_ready: _Optional[bool] = ..., prepared_error: _Optional[str] = ..., last_switch: _Optional[_Union[SwitchReport, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ..., error: _Optional[str] = ..., tokens_per_second: _Optional[float] = ..., prepared_layout: _Optional[str] = ..., prepared_devices: _Optional[_Iterable[int]] = ..., prepared_committed: _Optional[bool] = ..., snapshot_steps: _Optional[_Iterable[int]] = ..., mirror_of: _Optional[int] = ..., mirror_steps: _Optional[_Iterable[int]] = ..., checkpoint: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., previous_generation: _Optional[int] = ..., previous_layout: _Optional[str] = ..., previous_devices: _Optional[_Iterable[int]] = ..., previous_snapshot_steps: _Optional[_Iterable[int]] = ..., previous_mirror_of: _Optional[int] = ..., previous_mirror_steps: _Optional[_Iterable[int]] = ..., collective_wait_seconds: _Optional[float] = ..., leaving: _Optional[bool] = ..., leaving_in_seconds: _Optional[float] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("key", "keys", "value", "expected", "amount", "timeout_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_s: float
    def __init__(self, key: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("value", "number", "ok")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    number: int
    ok: bool
    def __init__(self, value: _Optional[bytes] = ..., number: _Optional[int] = ..., ok: _Optional[bool] = ...) -> None: ...
