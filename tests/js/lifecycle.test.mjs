import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { Sandbox, SandboxNotFoundError } from 'e2b'
import { adopt, sandbox } from './helpers.mjs'

test('info, timeout, list by metadata, kill', async () => {
  const tag = randomUUID()
  const sbx = await sandbox({ metadata: { suite: 'js', tag } })
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.templateId, 'base')
  assert.deepEqual(info.metadata, { suite: 'js', tag })

  await sbx.setTimeout(600_000)
  const moved = await sbx.getInfo()
  assert.ok(moved.endAt.getTime() - Date.now() > 500_000, `endAt ${moved.endAt}`)

  const listed = await Sandbox.list({ query: { metadata: { tag } } }).nextItems()
  assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])

  const other = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await other.commands.run('echo same')).stdout, 'same\n')

  assert.equal(await sbx.kill(), true)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
})

test('pause keeps memory and connect resumes in place', async () => {
  const sbx = await sandbox()
  await sbx.commands.run('sleep 600', { background: true })
  await sbx.files.write('/home/user/kept.txt', 'kept')
  assert.equal(await sbx.pause(), true)
  assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
  const resumed = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'running')
  assert.equal(await resumed.files.read('/home/user/kept.txt'), 'kept')
  assert.match((await resumed.commands.run('pgrep -x sleep')).stdout, /^\d+\n$/)
})

test('snapshots boot new sandboxes, forks are independent', async () => {
  const sbx = await sandbox()
  await sbx.files.write('/home/user/data.txt', 'from the snapshot')
  const snap = await sbx.createSnapshot()
  assert.ok(snap.snapshotId)
  const listed = await sbx.listSnapshots().nextItems()
  assert.ok(listed.some((s) => s.snapshotId === snap.snapshotId))

  const [child] = adopt(await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 }))
  assert.equal(await child.files.read('/home/user/data.txt'), 'from the snapshot')

  const forks = adopt(...await sbx.fork({ count: 2, timeoutMs: 120_000 }))
  assert.equal(forks.length, 2)
  await forks[0].files.write('/home/user/data.txt', 'changed in one fork')
  assert.equal(await forks[1].files.read('/home/user/data.txt'), 'from the snapshot')
  assert.equal(await sbx.files.read('/home/user/data.txt'), 'from the snapshot')

  await Sandbox.deleteSnapshot(snap.snapshotId)
  assert.ok(!(await sbx.listSnapshots().nextItems()).some((s) => s.snapshotId === snap.snapshotId))
})
