"""Which of torch's tests do not apply to nbremote, and why -- each checked against what it actually does.

A test is *not applicable* when it tests something nbremote does not claim: TorchScript, torch's profiler,
TensorPipe's device maps, torch's internals, CUDA (no GPU here or in CI), the parts of torch's per-process
start-up and shutdown that a running world cannot honour (the rest is nbremote's own, see ``ranks``). Every
such test is listed below with its reason and a piece of *evidence*: a string that must appear in what the
test raised (``"Type: message"`` and its traceback, or the skip message). A listed test that fails
otherwise, or passes, is reported -- the list cannot hide a failure that has another cause, or outlive a
fix. Tests that apply but fail are ``KNOWN_FAILURES``, each explained; they count as failures. (None at
present: the last two, torch's ``test_wait_all_exit_early_*``, pass since ``torch.futures.wait_all`` returns
at the first error of an nbremote future, see ``nbremote.frameworks._torch.route_wait_all``.)
"""

from __future__ import annotations

__all__ = ["DEADLINES", "KNOWN_FAILURES", "NOT_APPLICABLE", "NOT_RUN", "REASONS", "judge"]

TORCHSCRIPT = "torchscript"
PROFILER = "profiler"
INTERNALS = "internals"
STARTUP = "startup"
CUDA = "cuda"
TORCH_SKIPS = "torch-skips"
FAULTY = "faulty"
RREF_IDS = "rref-ids"
CALLEE_LOG = "callee-log"
TORCH_HANG = "torch-hang"
RM_LAYOUT = "remote-module-layout"

REASONS = {
    TORCHSCRIPT: "TorchScript: it sends @torch.jit.script functions or scripted RemoteModules by RPC, which torch runs "
                 "on its script-call path; nbremote sends Python functions (by name or by value), and a "
                 "ScriptFunction cannot be pickled",
    PROFILER: "torch's profiler: it reads the RPC events torch's agent records in torch.autograd.profiler (and the "
              "remote events it ships back); nbremote records none (its per-hop stamps: benchmarks/profile_call.py)",
    INTERNALS: "torch internals: it uses private parts of torch's RPC or autograd (rpc.api._all_gather, "
               "_get_current_rpc_agent, _set_rpc_timeout, _rref_context_get_debug_info, rpc.api._wait_all, "
               "dist_autograd._current_context and its send/recv functions, ...), which the overlay takes from "
               "torch, whose own agent is not running",
    STARTUP: "torch's per-process start-up where a running world cannot honour it: init_rpc there joins the world the "
             "process is in and shutdown waits for the others without ending it (tests of that, the types of backend "
             "and options, a second init_rpc, pass); these assert that a process has no RPC before init_rpc or after "
             "shutdown, that init_rpc is a rendezvous failing on every rank at once (a duplicate name given to torch's "
             "private _init_rpc_backend, static and dynamic members mixed), a name or world size that is no member's, "
             "a stub backend in torch's registry, a missing rank, or the RRef-leak check at shutdown (see ranks.py, "
             "and the README on start-up)",
    CUDA: "CUDA: torch skips it without enough CUDA devices (none here or in CI); most of these test TensorPipe's "
          "device maps, which nbremote has no counterpart of (a CUDA tensor travels through the CPU and is rebuilt "
          "on the same device)",
    TORCH_SKIPS: "torch skips it itself (the message links torch's issue)",
    FAULTY: "torch's fault-injecting agent (FAULTY_TENSORPIPE)",
    RREF_IDS: "torch's RRef ids: it expects GloballyUniqueId(created_on=..., local_id=N), counted from 0 in a fresh "
              "process, in a message or repr; nbremote's RRef ids are random (the behaviour -- the error on a "
              "non-owner, the repr -- is there, in other words)",
    CALLEE_LOG: "the callee's log: it expects torch's agent to print a failing function's error on the callee's "
                "stderr; nbremote sends the error, with its traceback, to the caller and prints nothing on the "
                "callee (a worker's stderr is a log file, the driver's is the notebook)",
    TORCH_HANG: "it asserts that torch hangs: torch's FAST-mode backward waits forever for the gradients of an RPC "
                "whose result was not used; nbremote's backward finishes",
    RM_LAYOUT: "torch's RemoteModule internals: it compares a handle's __dict__ with torch's "
               "_REMOTE_MODULE_PICKLED_ATTRIBUTES (is_device_map_set, is_scriptable, generated_methods); nbremote's "
               "handle has attributes of its own",
}

#: Class.test -> (reason, evidence: a string that must appear in what the test raised or the skip message)
NOT_APPLICABLE: dict[str, tuple[str, str]] = {
    # rpc_test.py
    "RpcTest.test_all_gather": (INTERNALS, "results = rpc.api._all_gather(info.id)"),
    "RpcTest.test_all_gather_timeout": (INTERNALS, "rpc._set_rpc_timeout(0.1)"),
    "RpcTest.test_async_record_function_cbs_jit_call": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_debug_info": (INTERNALS, "info = _get_debug_info()"),
    "RpcTest.test_default_timeout_used": (INTERNALS, "rpc._set_rpc_timeout(0.001)"),
    "RpcTest.test_disable_gil_profiling": (INTERNALS, "info = rpc.api._get_current_rpc_agent().get_debug_info()"),
    "RpcTest.test_duplicate_name": (STARTUP, '"is not unique" does not match'),
    "RpcTest.test_get_worker_infos": (INTERNALS, "rpc.api._get_current_rpc_agent().get_worker_infos()"),
    "RpcTest.test_handle_send_exceptions": (INTERNALS, "rpc._set_rpc_timeout(10)"),
    "RpcTest.test_local_value_not_on_owner": (RREF_IDS, "For UserRRef\\(rref_id=GloballyUniqueId\\(created_on="),
    "RpcTest.test_pg_init_no_rpc_init": (STARTUP, "AssertionError: RuntimeError not raised"),
    "RpcTest.test_profiler_export_trace": (PROFILER, "self.assertTrue(event_exists)"),
    "RpcTest.test_profiler_remote_events_profiled":
        (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_remote_events_profiled_single_threaded":
        (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_rpc_key_names": (TORCH_SKIPS, "https://github.com/pytorch/pytorch/issues/125365"),
    "RpcTest.test_profiler_rpc_memory": (PROFILER, "self.assertEqual({0}, event_cpu_mem_usages)"),
    "RpcTest.test_profiler_rpc_record_shapes": (PROFILER, "remote_add_event = next("),
    "RpcTest.test_profiler_with_async_rpc_builtin":
        (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_with_async_rpc_builtin_single_threaded":
        (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_with_async_rpc_udf": (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_with_async_rpc_udf_single_threaded":
        (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_with_autograd_context": (PROFILER, 'self.assertTrue("aten::mul" in remote_events)'),
    "RpcTest.test_profiler_with_autograd_context_single_threaded":
        (PROFILER, 'self.assertTrue("aten::mul" in remote_events)'),
    "RpcTest.test_profiler_with_remote_builtin": (PROFILER, "rref._get_profiling_future().wait()"),
    "RpcTest.test_profiler_with_remote_builtin_single_threaded": (PROFILER, "rref._get_profiling_future().wait()"),
    "RpcTest.test_profiler_with_remote_udf": (PROFILER, "rref._get_profiling_future().wait()"),
    "RpcTest.test_profiler_with_remote_udf_single_threaded": (PROFILER, "rref._get_profiling_future().wait()"),
    "RpcTest.test_profiler_with_script_async_rpc": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_profiler_with_script_async_rpc_single_threaded": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_profiler_with_script_remote_rpc": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_profiler_with_script_remote_rpc_single_threaded": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_profiler_with_script_sync_rpc": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_profiler_with_script_sync_rpc_single_threaded": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_profiler_with_sync_rpc_builtin": (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_with_sync_rpc_builtin_single_threaded":
        (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_with_sync_rpc_udf": (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_profiler_with_sync_rpc_udf_single_threaded":
        (PROFILER, "in function_events if partial_event_name in event.name"),
    "RpcTest.test_py_raise_in_user_func": (CALLEE_LOG, "self.assertTrue(expected_err in stderr_lines)"),
    "RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend":
        (STARTUP, "init_rpc(name='worker1', rank=0, world_size=4): the name differs"),
    "RpcTest.test_rpc_barrier_all": (INTERNALS, "rpc._get_current_rpc_agent().get_worker_infos()"),
    "RpcTest.test_rpc_barrier_multithreaded": (INTERNALS, "rpc._get_current_rpc_agent().get_worker_infos()"),
    "RpcTest.test_rpc_barrier_partial_subset": (INTERNALS, "rpc._get_current_rpc_agent().get_worker_infos()"),
    "RpcTest.test_rpc_barrier_subset": (INTERNALS, "rpc._get_current_rpc_agent().get_worker_infos()"),
    "RpcTest.test_rpc_profiling_async_function": (PROFILER, "self.assertEqual(1, len(rpc_remote_event))"),
    "RpcTest.test_rpc_profiling_async_function_single_threaded":
        (PROFILER, "self.assertEqual(1, len(rpc_remote_event))"),
    "RpcTest.test_rpc_profiling_remote_record_function":
        (PROFILER, "self.assertEqual(1, len(record_function_remote_event))"),
    "RpcTest.test_rpc_timeouts": (INTERNALS, "rpc._set_rpc_timeout(0.001)"),
    "RpcTest.test_rref_context_debug_info": (INTERNALS, "info = _rref_context_get_debug_info()"),
    "RpcTest.test_rref_get_future": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_rref_leak": (STARTUP, 'assertRaisesRegex(RuntimeError, "Leaking RRef")'),
    "RpcTest.test_rref_str": (RREF_IDS, "'OwnerRRef(GloballyUniqueId(created_on="),
    "RpcTest.test_rref_timeout": (INTERNALS, "debug_info = _rref_context_get_debug_info()"),
    # The type _get_type answers is right (tests/test_rpc_rref.py); what fails is the profiler event torch's
    # agent records for the RPC behind it ("rpc_async#_rref_typeof_on_owner"), asserted before the type.
    "RpcTest.test_rref_type_blocking": (PROFILER, "self.assertTrue(launched_rpc(p.function_events))"),
    "RpcTest.test_rref_type_non_blocking": (PROFILER, "self.assertTrue(launched_rpc(p.function_events))"),
    "RpcTest.test_server_process_global_profiler":
        (PROFILER, "AssertionError: The length of the sequences mismatch: 0 != 1"),
    "RpcTest.test_shutdown_errors": (STARTUP, '"timed out in _all_gather"'),
    "RpcTest.test_shutdown_followed_by_rpc": (STARTUP, '"^RPC has not been initialized"'),
    "RpcTest.test_stress_heavy_rpc_torchscript": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_use_rref_after_shutdown": (STARTUP, "AssertionError: RuntimeError not raised"),
    "RpcTest.test_wait_all": (INTERNALS, "self.assertTrue(len(_thread_local_var.future_list) == 1)"),
    "RpcTest.test_wait_all_exit_early_script_function": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "RpcTest.test_wait_all_multiple_call": (INTERNALS, "self.assertTrue(len(_thread_local_var.future_list) == 20)"),
    "RpcTest.test_wait_all_raise_in_user_func": (INTERNALS, "self.assertRaises(ValueError), _wait_all()"),
    "RpcTest.test_wait_all_timeout": (INTERNALS, "expected_error), _wait_all()"),
    "RpcTest.test_wait_all_workers_dense": (INTERNALS, "rpc.api._wait_all_workers()"),
    "RpcTest.test_wait_all_workers_timeout": (INTERNALS, "not run: "),
    "RpcTest.test_wait_all_workers_twice_dense": (INTERNALS, "rpc.api._wait_all_workers()"),
    "RpcTest.test_worker_info_pickle": (INTERNALS, "worker_info = rpc.api.get_worker_info()"),
    "RpcTest.test_world_size_one": (STARTUP, "init_rpc(name='me', rank=0, world_size=1): the name differs"),
    "CudaRpcTest.test_profiler_remote_cuda": (TORCH_SKIPS, "https://github.com/pytorch/pytorch/issues/154587"),
    "TensorPipeAgentRpcTest.test_dynamic_and_static_init_rpc_together":
        (STARTUP, "init_rpc(name='worker0', rank=0, world_size=3): the world size differs"),
    "TensorPipeAgentRpcTest.test_dynamic_rpc_init_rpc_without_rank": (STARTUP, '"rank parameter missing"'),
    "TensorPipeAgentRpcTest.test_infer_backend_from_options":
        (INTERNALS, "rpc.api._get_current_rpc_agent(), rpc.TensorPipeAgent"),
    "TensorPipeAgentRpcTest.test_set_and_get_num_worker_threads":
        (INTERNALS, "info = rpc.api._get_current_rpc_agent().get_debug_info()"),
    "TensorPipeAgentRpcTest.test_wait_all_workers_sparse": (INTERNALS, "rpc.api._wait_all_workers()"),
    "TensorPipeAgentRpcTest.test_wait_all_workers_twice_sparse": (INTERNALS, "rpc.api._wait_all_workers()"),
    "TensorPipeAgentRpcTest.test_world_size_one_sparse":
        (STARTUP, "init_rpc(name='me', rank=0, world_size=1): the name differs"),
    # dist_autograd_test.py
    "TensorPipeAgentDistAutogradTest.test_backward_simple_script_call_sparse":
        (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_call_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_remote_call_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_itself_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_itself_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_call_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_remote_call_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_sparse":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "TensorPipeAgentDistAutogradTest.test_remote_complex_args_sparse":
        (INTERNALS, "dist_autograd._current_context()._send_functions()"),
    "TensorPipeAgentDistAutogradTest.test_rpc_complex_args_sparse":
        (INTERNALS, "dist_autograd._current_context()._send_functions()"),
    "DistAutogradTest.test_autograd_context": (INTERNALS, "dist_autograd._get_max_id()"),
    "DistAutogradTest.test_backward_node_failure": (INTERNALS, "rpc._set_rpc_timeout(5)"),
    "DistAutogradTest.test_backward_node_failure_python_udf": (INTERNALS, "rpc._set_rpc_timeout(5)"),
    "DistAutogradTest.test_backward_simple_script_call": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "DistAutogradTest.test_backward_unused_send_function": (TORCH_HANG, "self.assertTrue(t.is_alive())"),
    "DistAutogradTest.test_clean_context_during_backward": (INTERNALS, "context = dist_autograd._new_context()"),
    "DistAutogradTest.test_debug_info": (INTERNALS, "dist_autograd.backward(context_id, [res[i].sum()])"),
    "DistAutogradTest.test_dist_autograd_profiling":
        (PROFILER, "event for event in function_events if partial_key in event.name"),
    "DistAutogradTest.test_graph_for_builtin_call": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_graph_for_builtin_remote_call": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_graph_for_py_nested_call": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_graph_for_py_nested_call_itself": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_graph_for_py_nested_remote_call": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_graph_for_py_nested_remote_call_itself":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_graph_for_python_call": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_graph_for_python_remote_call": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote":
        (INTERNALS, "ctx = dist_autograd._current_context()"),
    "DistAutogradTest.test_remote_complex_args": (INTERNALS, "dist_autograd._current_context()._send_functions()"),
    "DistAutogradTest.test_rpc_complex_args": (INTERNALS, "dist_autograd._current_context()._send_functions()"),
    "DistAutogradTest.test_trainer_ps_torchscript_functions": (TORCHSCRIPT, "ScriptFunction cannot be pickled"),
    "DistAutogradTest.test_worker_ids_recorded": (INTERNALS, "ctx = dist_autograd._current_context()"),
    "FaultyAgentDistAutogradTest.test_verify_backend_options": (FAULTY, "BackendType.FAULTY_TENSORPIPE"),
    # remote_module_test.py
    "RemoteModuleTest.test_forward_async": (TORCHSCRIPT, "_RemoteModule("),
    "RemoteModuleTest.test_forward_async_script": (TORCHSCRIPT, "_RemoteModule("),
    "RemoteModuleTest.test_forward_sync": (TORCHSCRIPT, "_RemoteModule("),
    "RemoteModuleTest.test_forward_sync_script": (TORCHSCRIPT, "_RemoteModule("),
    "RemoteModuleTest.test_remote_module_py_pickle_not_supported_script": (TORCHSCRIPT, "_RemoteModule("),
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire":
        (RM_LAYOUT, "self.assertListEqual(list(attrs.keys()), expected_unpickled_attrs)"),
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported":
        (TORCHSCRIPT, "_RemoteModule("),}

#: Class.test -> why: tests the runner does not run, listed as not applicable with the evidence "not run: "
NOT_RUN: dict[str, str] = {
    # It patches torch's rpc.api._wait_all_workers to make shutdown slow and asserts that shutdown(timeout=0.01)
    # raises. nbremote's shutdown never calls it (its barrier is the driver's), so whether the test's four ranks
    # meet within 10 ms is a matter of timing: it passed in 1 of 3 runs here.
    "RpcTest.test_wait_all_workers_timeout": "it makes torch's internal _wait_all_workers slow to time shutdown out",
}

#: skipped for want of CUDA devices: every test torch skips so (about a hundred, in its CUDA suites)
_CUDA_SKIP = ("Need at least", "CUDA device")

#: Class.test -> (why it fails, evidence): tests that apply and fail
KNOWN_FAILURES: dict[str, tuple[str, str]] = {}

#: Class.test -> seconds: tests known to block until the deadline (a known failure waiting forever, a test
#: whose ranks wait for others that failed, at a barrier of torch's gloo group), so that they cost little
DEADLINES: dict[str, float] = {
    "TensorPipeAgentRpcTest.test_dynamic_and_static_init_rpc_together": 5.0,
}


def judge(test: str, outcome: str, text: str) -> tuple[str, str]:
    """``(verdict, why)`` for ``test`` (``Class.method``) that ended with ``outcome`` ("pass", "fail", "skip",
    "deadline") and raised ``text``; verdicts: "pass", "n/a", "known" (a known failure), "fail"."""
    listed = NOT_APPLICABLE.get(test)
    if listed is None and outcome == "skip" and all(s in text for s in _CUDA_SKIP):
        listed = (CUDA, _CUDA_SKIP[0])
    known = KNOWN_FAILURES.get(test)
    if outcome == "pass":
        if listed or known:
            listing = "not applicable" if listed else "a known failure"
            return "fail", f"passes, but is listed as {listing}: update the list"
        return "pass", ""
    if listed:
        reason, evidence = listed
        if evidence in text:
            return "n/a", reason
        return "fail", f"listed as not applicable ({reason}) for {evidence!r}, but: {text.splitlines()[0]}"
    if known:
        why, evidence = known
        if evidence in text:
            return "known", why
        return "fail", f"a known failure ({evidence!r}) that failed otherwise: {text.splitlines()[0]}"
    return "fail", text.splitlines()[0] if text else outcome
