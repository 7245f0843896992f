# cmake -P script: install, configure the consumer, build it, run it.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run("cmake --install" ${CMAKE_COMMAND} --install ${STRATA_BINARY_DIR} --prefix ${prefix})
foreach(f include/strata/core/status.h include/strata/core/config.h
          include/strata/offload/cpu/host_pool.h include/strata_generated/version.h
          lib/cmake/Strata/StrataConfig.cmake bin/strata-config)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "cmake --install did not install ${f}")
  endif()
endforeach()
run("configuring the consumer" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
    -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix})
run("building the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run("running the consumer" ${WORK_DIR}/build/consumer)
if(NOT last_output MATCHES "train_micro_batch_size_per_gpu=4")
  message(FATAL_ERROR "unexpected consumer output:\n${last_output}")
endif()
run("running the installed strata-config" ${prefix}/bin/strata-config --version)
if(EXISTS ${STRATA_BINARY_DIR}/lib/libstrata_engine.so AND NOT EXISTS ${WORK_DIR}/build/engine_consumer)
  message(FATAL_ERROR "Strata::engine is installed but the consumer could not build against it "
                      "(its CMake package did not find LibTorch)")
endif()
if(EXISTS ${WORK_DIR}/build/engine_consumer)
  run("running the engine consumer" ${WORK_DIR}/build/engine_consumer)
  if(NOT last_output MATCHES "engine consumer: loss")
    message(FATAL_ERROR "unexpected engine consumer output:\n${last_output}")
  endif()
endif()

# The installed Python package (when the bindings were built) imports from the prefix
# alone: its extension finds the installed libraries through its RPATH.
file(GLOB py_ext ${prefix}/lib*/python3/dist-packages/strata/_strata*.so)
if(py_ext)
  list(GET py_ext 0 ext)
  get_filename_component(pkg_dir ${ext} DIRECTORY)
  get_filename_component(site_dir ${pkg_dir} DIRECTORY)
  run("importing the installed strata package" ${CMAKE_COMMAND} -E env PYTHONPATH=${site_dir}
      ${PYTHON} ${CMAKE_CURRENT_LIST_DIR}/check_import.py)
  if(NOT last_output MATCHES "${site_dir}/strata/__init__.py 1.5 KiB")
    message(FATAL_ERROR "the installed package did not import from the prefix:\n${last_output}")
  endif()
endif()
message(STATUS "consumer output: ${last_output}")
