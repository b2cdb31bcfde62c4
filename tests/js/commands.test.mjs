import { test } from 'node:test'
import assert from 'node:assert/strict'
import { CommandExitError } from 'e2b'
import { sandbox, waitFor } from './helpers.mjs'

test('stdout, stderr, exit codes, cwd, envs and users', async () => {
  const sbx = await sandbox({ envs: { FROM_SANDBOX: 'everywhere' } })
  const ok = await sbx.commands.run('echo out; echo err >&2; echo $FROM_SANDBOX $PER_CALL; pwd; whoami', {
    envs: { PER_CALL: 'once' },
  })
  assert.equal(ok.exitCode, 0)
  assert.equal(ok.stdout, 'out\neverywhere once\n/home/user\nuser\n')
  assert.equal(ok.stderr, 'err\n')

  await assert.rejects(sbx.commands.run('echo partial; exit 3'), (e) => {
    assert.ok(e instanceof CommandExitError)
    assert.equal(e.exitCode, 3)
    assert.equal(e.stdout, 'partial\n')
    return true
  })
  assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
  assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
})

test('output streams to callbacks while the command runs', async () => {
  const sbx = await sandbox()
  const seen = []
  await sbx.commands.run('for i in 1 2 3; do echo $i; sleep 0.2; done', {
    onStdout: (line) => seen.push([line, Date.now()]),
  })
  assert.deepEqual(seen.map(([l]) => l).join(''), '1\n2\n3\n')
  assert.ok(seen.at(-1)[1] - seen[0][1] >= 300, 'the lines arrived together, not streamed')
})

test('background commands are listed, take stdin and can be killed', async () => {
  const sbx = await sandbox()
  const cat = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(cat.pid, 'fed through stdin\n')
  await sbx.commands.closeStdin(cat.pid)
  const done = await cat.wait()
  assert.equal(done.stdout, 'fed through stdin\n')

  const sleeper = await sbx.commands.run('sleep 600', { background: true })
  assert.ok((await sbx.commands.list()).some((p) => p.pid === sleeper.pid))
  assert.equal(await sleeper.kill(), true)
  await waitFor('the killed command to leave the list', async () =>
    !(await sbx.commands.list()).some((p) => p.pid === sleeper.pid))
})

test('a PTY echoes input and honours its size', async () => {
  const sbx = await sandbox()
  let output = ''
  const decoder = new TextDecoder()
  const pty = await sbx.pty.create({ cols: 91, rows: 27, onData: (d) => { output += decoder.decode(d) } })
  await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; echo pty-$((6*7))\n'))
  await waitFor('the PTY to answer', () => output.includes('27 91') && output.includes('pty-42'))
  await sbx.pty.resize(pty.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size\nexit\n'))
  await waitFor('the resized size', () => output.includes('30 100'))
  await pty.wait().catch(() => {})
})
